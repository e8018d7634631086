"""The data layer: records → tokenised documents (prepare) → the store → planned batches (plan, collate, loader).

Imports nothing from ``densebatch.model`` or ``densebatch.train``. Import submodules directly,
e.g. ``from densebatch.data.prepare.pipeline import prepare``.
"""
