"""Planning benchmarks: fill rate per strategy, planning time and memory, the loader's memory, collate time."""
