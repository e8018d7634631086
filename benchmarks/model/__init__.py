"""Model benchmarks: attention backends, the loss head's speed and memory, the Hugging Face adapter's tolerances."""
