"""Integrations: densebatch's batches inside other trainers (Hugging Face ``Trainer``, TRL).

``trl_dpo.py``: ``dense_batches`` for TRL's ``DPOTrainer`` (pairs planned as units by a token budget, TRL's
collator and loss kept). Import from the modules themselves.
"""
