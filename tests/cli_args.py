"""Command-line overrides shared by the CLI tests: a tiny GPT on a few hundred generated records."""

TINY = [
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=256",
    "--data.max_seq_len=256",
    "--batching.seq_len=256",
    "--batching.max_tokens_per_batch=1024",
    "--train.loss_tokens_per_step=null",  # one batch a step (the demo's 96 loss tokens would be ~4 of these batches)
    "--data.default.num_records=200",
    "--train.progress=false",
    "--eval.accuracy_samples=0",
    "--train.plots=false",  # drawing the end-of-run plots costs ~4 s a run; tests/cli/test_observability_cli.py draws them
]
