"""Context parallelism's training side: the data × context mesh of ranks, and rows cut over the context ranks.

``mesh.py`` (``ContextRanks``: the world as torch's ``DeviceMesh`` of data × context ranks; which data rank
reads which share of a step), ``shards.py`` (``shard_batch``: a batch's columns for one context rank;
``ShardedSteps``: a source of steps whose batches are this rank's columns). Attention across the ranks is the
model's (``model/context_attention.py``); the plan and the collator do not change. Import from the modules.
"""
