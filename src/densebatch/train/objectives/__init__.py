"""Objectives: what a step's loss is, from the model's per-token log-probabilities and the batch's layout.

``sft`` is the loop's own (next-token cross-entropy over a step's loss tokens, ``train/loop.py``); the
preference objectives train on pairs (``Batch.pairs``): ``pair_logps.py`` (each pair's summed
log-probabilities of its chosen and rejected answer, and the prompt's and chosen answer's cross-entropy),
``losses.py`` (dpo, simpo, orpo as TRL defines them: ``OBJECTIVES``), ``reference.py`` (the reference model:
the starting weights, live or precomputed), ``steps.py`` (a step's passes, exact over micro-batches and
ranks, and its metrics, as TRL names them; evaluation). Import from the modules themselves.
"""
