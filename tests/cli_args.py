"""Command-line overrides shared by the CLI tests: a tiny GPT on a few hundred generated records.

``TINY`` is the whole set; a test that trains a Hugging Face model, reads data of its own or plans with a
strategy other than packed leaves out what does not apply there (``tiny``): a key set where it has no effect
is noted on stderr (config/applies.py), which a test that counts the lines of stderr would see.
"""

GPT = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=256"]  # model.kind gpt
DEFAULT_DATA = ["--data.default.num_records=200"]  # the embedded default dataset
PACKED = ["--batching.seq_len=256"]  # packed rows

TINY = [
    *GPT,
    "--data.max_seq_len=256",
    *PACKED,
    "--batching.max_tokens_per_batch=1024",
    "--train.loss_tokens_per_step=null",  # one batch a step (the demo's 96 loss tokens would be ~4 of these batches)
    *DEFAULT_DATA,
    "--train.progress=false",
    "--eval.accuracy_samples=0",
    "--train.plots=false",  # drawing the end-of-run plots costs ~4 s a run; tests/cli/test_observability_cli.py draws them
]


def tiny(*, gpt: bool = True, default_data: bool = True, packed: bool = True) -> list[str]:
    """``TINY`` without the reference GPT's keys (a Hugging Face model), the embedded dataset's (data of one's
    own) or packed rows' (another strategy)."""
    left_out = [*([] if gpt else GPT), *([] if default_data else DEFAULT_DATA), *([] if packed else PACKED)]
    return [a for a in TINY if a not in left_out]
