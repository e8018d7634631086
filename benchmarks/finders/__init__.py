"""Finder benchmarks: the learning-rate finder's suggestion against grids of whole training runs."""
