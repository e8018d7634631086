"""The document store: the artifact between the stages, which prepare writes and plan, load and the Python API read.

One prepared split on disk (``store.DocumentStore``), its positioned reads and completion marker
(``store_io``), its writer (``store_write``), its shards read as one array (``joined``) and a source's
lengths read in place (``spans``). Import submodules directly; this package re-exports nothing.
"""
