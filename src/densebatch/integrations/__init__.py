"""Integrations: densebatch inside other projects' trainers (Hugging Face ``Trainer``, TRL), a room of its own.

``hf_trainer.py`` (``dense_batches`` / ``undo_dense_batches``: a trainer's training batches planned by
densebatch; ``register_attention``), ``hf_loss.py`` (the trainer's ``compute_loss`` on densebatch's fused chunked
head, and why it is refused where it would not be exact), ``fused_forward.py`` (one forward of the wrapped model
answering per-token losses, nothing left on the model), ``installed.py`` (what was set on a trainer, and what
each attribute held before), ``sources.py`` (each source's weight of its loss tokens), ``trl_dpo.py`` (``dense_batches`` for TRL's ``DPOTrainer``: pairs planned as units by a token budget, TRL's collator and loss kept). These modules wire ``data/`` and ``model/`` together as ``run/`` does for the command
line; no layer imports them, and they import nothing of ``run/`` or ``cli``. The public names are
``densebatch.dense_batches``, ``densebatch.undo_dense_batches`` and ``densebatch.register_attention``. Import from the modules themselves.
"""
