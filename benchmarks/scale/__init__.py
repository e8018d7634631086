"""Scale-out: per-rank memory of building, checkpointing and resuming a model under FSDP (``state_memory``)."""
