"""Corpora other engines wrote (Megatron / NeMo indexed datasets, ...), read in place as document stores."""
