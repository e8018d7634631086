"""Training throughput benchmarks: densebatch against Hugging Face Trainer and plain loops, step profiles, metrics cost."""
