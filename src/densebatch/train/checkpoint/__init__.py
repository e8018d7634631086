"""Checkpoints: a run's whole state saved atomically, verified, and read back on any number of ranks.

``manager.py`` (``CheckpointManager``: save, verify, restore, prune), ``dirs.py`` (naming, verifying,
pruning, ``latest_valid``), ``shards.py`` (who writes which rows, how any number of ranks reads them),
``async_saves.py`` (saves staged in host memory, written in the background), ``format.py`` (the state
as a JSON tree with its tensors split out; ``CheckpointError``), ``portable.py`` (model and name-keyed
optimizer state, DTensor shards under FSDP), ``rng.py`` (every RNG state as JSON). Import from the
modules themselves.
"""
