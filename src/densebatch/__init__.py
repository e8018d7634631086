"""densebatch: train causal language models with dense batches (packed or token-budget)."""

__version__ = "0.1.0"
