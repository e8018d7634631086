"""Observation: what a run records and shows (``monitor``), other sinks (``sinks``), health warnings
(``health``) and plots (``plots``). Reads the loop's records; never changes what the loop computes."""
