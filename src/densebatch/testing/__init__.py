"""Reference implementations and tiny builders that test and benchmark densebatch (as ``numpy.testing``).

Both tests/ and benchmarks/ import from here, so neither imports the other. No module of the rest of
the package imports it: it is a leaf that reads the layers, never a layer they read. Import its
modules directly:

- ``batches``: ``pack`` token lists into a ``Batch`` by the batch.py convention, random documents.
- ``models``: a tiny reference GPT, tiny random Hugging Face configurations (one per architecture
  the adapter supports or refuses) and the packed-against-alone measure of document isolation.
- ``book``: the book's reference collate and prompt text (../shared/data/README.md), which the
  collate equivalence test and the collate benchmark compare with.
"""
