"""Planning: which document pieces go in which row, batch and optimizer step, from lengths alone.

numpy only (no torch, no I/O; a guard test holds it): the strategies (``strategies``, one object each;
``planner`` plans an epoch with them), the packing
algorithms (``packing``), plans built shard by shard (``shards``), weighted mixtures (``mixture``,
``bijection``), the epoch of a prepared store (``store_epochs``) and the cut of an epoch into steps
shared out to ranks (``steps``). Every function is pure in (lengths, settings, seed, epoch).
"""
