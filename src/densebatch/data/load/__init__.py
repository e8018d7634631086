"""Loading: planned batches → ``Batch`` tensors (``collate``), streamed step by step, resumably (``loader``)."""
