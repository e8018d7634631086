"""Quality benchmarks: time to a target quality per batching plan (not fill alone)."""
