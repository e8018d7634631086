"""Benchmarks of densebatch, measured by hand (never inside tests), grouped by what they measure.

Run each as a module from the repository root, e.g. ``.venv/bin/python -m benchmarks.planning.fill_bench``;
docs/benchmarks.md lists every command beside the figures it gave.

- ``planning``: fill rates, planning time and memory, the loader's memory, collate time.
- ``throughput``: training throughput against Hugging Face Trainer and plain loops, where a step's
  time goes, the cost of the per-step metrics.
- ``model``: attention backends, the loss head's speed and memory, Hugging Face adapter tolerances.
- ``gpu``: throughput, MFU and memory on a CUDA device against Hugging Face Trainer (``bash benchmarks/gpu.sh``).
- ``finders``: the learning-rate finder against grids of whole training runs.
- ``common``: what several groups share (../shared/data, its sets and their lengths, the GPT-2 config).

Benchmarks import densebatch, ``densebatch.testing`` and each other, never tests/.
"""
