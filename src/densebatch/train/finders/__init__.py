"""Finders: the learning-rate range test (``lr_finder``) and the reading of its curve (``lr_curve``),
and the token budget fitted to memory (``budget_finder``)."""
