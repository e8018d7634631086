"""Command line: parse arguments, load the configuration, call ``run``; user mistakes exit 2 without a traceback.

    densebatch prepare  [CONFIG] [--section.key=value ...]
    densebatch inspect  [CONFIG] [--num N] [--split train|eval]
    densebatch analyze  [CONFIG | --lengths FILE] [--json] [--strategy S] [--dump-plan FILE] [--plot FILE]
    densebatch train    [CONFIG] [--resume | --overwrite]
    densebatch find-lr  [CONFIG]     (learning-rate range test: output_dir/lr_finder.png and .json)
    densebatch find-batch [CONFIG]   (largest max_tokens_per_batch the memory holds, and throughput)
    densebatch eval     [CONFIG] --checkpoint DIR [--json]   (no CONFIG: the run's own configuration)
    densebatch generate --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--raw]
    densebatch export   RUN_DIR OUT
    densebatch plot     RUN_DIR      (PNGs of loss, lr, gradient norm, throughput, memory: RUN_DIR/plots)
    densebatch config   [CONFIG] [--keys]

With no CONFIG, the embedded default (a built-in instruction dataset and a small GPT) is used.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from densebatch.config import FinderConfig, RunConfig
from densebatch.errors import UserError


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate config overrides — ``--section.key=value``, ``--output_dir=DIR``, ``--seed=1`` (also
    written ``--section.key value``) — from the other arguments."""
    # Top-level scalars only: `--checkpoint DIR` is a command argument, not the checkpoint section.
    top = {f.name for f in fields(RunConfig) if f.type in ("str", "int", str, int)}
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in name or name in top:
            if "=" not in arg:
                if i + 1 >= len(argv):
                    raise UserError(f"override '{arg}' has no value: write {arg}=VALUE")
                arg = f"{arg}={argv[i + 1]}"
                i += 1
            overrides.append(arg)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="densebatch",
        description="Train causal language models (and encoder masked LMs: batching.mode mlm) with dense batches. "
        "Any config field can be overridden as --section.key=value (e.g. --train.max_steps=20).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("config", metavar="CONFIG", nargs="?", help="YAML run configuration (default: the embedded default)")
        return sp

    with_config("prepare", "Read, clean, template and tokenise records into cached documents.")

    sp = with_config("inspect", "Show prepared documents decoded, with the tokens that carry loss marked.")
    sp.add_argument("--num", type=int, default=3, help="documents to show (default 3)")
    sp.add_argument("--split", choices=("train", "eval"), default="train")
    sp.add_argument("--start", type=int, default=0, help="index of the first document shown")

    sp = with_config("analyze", "Compare batching strategies (fill rate, batches, planning time) on a dataset's lengths.")
    sp.add_argument("--lengths", metavar="FILE", help="document lengths: text (one integer per line) or .npy")
    sp.add_argument("--json", action="store_true", help="print one JSON object keyed by strategy")
    sp.add_argument(
        "--strategy",
        help="analyze this strategy only (and write its plan with --dump-plan; default: every strategy, batching.strategy's plan)",
    )
    sp.add_argument("--dump-plan", metavar="FILE", help="write the plan as JSON: batches → rows → document indices")
    sp.add_argument("--plot", metavar="FILE", help="write a PNG histogram of lengths with each strategy's fill rate")

    sp = with_config("train", "Train (with no CONFIG: the embedded default task and a small GPT).")
    sp.add_argument("--resume", action="store_true", help="continue the saved run from its newest verified checkpoint")
    sp.add_argument("--overwrite", action="store_true", help="delete the run already in output_dir and start over")

    sp = with_config(
        "find-lr", "Learning-rate range test from the run's initial weights: suggests train.lr (lr_finder.png / .json)."
    )
    sp.add_argument(
        "--trials",
        type=int,
        metavar="N",
        help="finder.trials: " + next(f.metadata["help"] for f in fields(FinderConfig) if f.name == "trials"),
    )
    with_config(
        "find-batch", "Largest batching.max_tokens_per_batch whose worst batch fits the memory, and where throughput levels off."
    )

    sp = sub.add_parser(
        "eval",
        help="Token-weighted loss and perplexity of a checkpoint on the evaluation split.",
        description="Token-weighted loss and perplexity of a checkpoint on the evaluation split. Without CONFIG the "
        "run's own configuration (saved with the weights) decides everything. With CONFIG, the run still decides its "
        "tokenizer, template and model (data.tokenizer, data.add_tokens, data.add_special_tokens, data.pad_id, "
        "data.max_seq_len, data.overlong, data.clean, data.template, data.fields, data.prompt_format, data.loss_on, "
        "the same keys of each source, batching.mode, model.*): CONFIG chooses which data to score (data.path, "
        "data.sources, data.eval_path, data.eval_fraction, data.format, data.cache_dir, ...) and the batching, eval, "
        "device and precision. Each run-owned key that CONFIG (or an override) sets otherwise is noted on stderr, one "
        "line each, and the run's value used.",
    )
    sp.add_argument(
        "config", metavar="CONFIG", nargs="?", help="YAML run configuration (default: the run's own, saved with the weights)"
    )
    sp.add_argument("--checkpoint", required=True, metavar="DIR", help="a final model dir, a checkpoint dir, or an output_dir")
    sp.add_argument("--json", action="store_true", help="print one JSON object")

    sp = sub.add_parser(
        "generate",
        help="Generate text from a trained model.",
        description="Generate text from a trained model, with its run's tokenizer. --prompt goes through the run's "
        "template as a user's turn: alpaca (the instruction), chatml, chat_template (the tokenizer's own, with the "
        "generation prompt), custom (the one field of data.prompt_format; with several, a JSON object of them); a "
        "mixture whose sources' templates differ uses the first source's (noted on stderr). --raw sends it verbatim.",
    )
    sp.add_argument("--checkpoint", required=True, metavar="DIR", help="a final model dir, a checkpoint dir, or an output_dir")
    sp.add_argument(
        "--prompt",
        required=True,
        metavar="TEXT",
        help='the user\'s text; for a custom template with several fields, a JSON object: \'{"field": "...", ...}\'',
    )
    sp.add_argument("--max-new-tokens", type=int, default=64)
    sp.add_argument("--temperature", type=float, default=0.0, help="a finite number >= 0; 0 = greedy")
    sp.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="with --temperature > 0: sample among the k most likely tokens (k >= 1; default all)",
    )
    sp.add_argument("--raw", action="store_true", help="send the prompt verbatim instead of through the run's template")

    sp = sub.add_parser(
        "export",
        help="Write a trained model as a Hugging Face model directory (from_pretrained / AutoTokenizer load it).",
        description="Write a trained model (final model, checkpoint or output_dir) as a Hugging Face model directory: "
        "the reference GPT as GPT-2, a Hugging Face model with save_pretrained; its tokenizer beside it.",
    )
    sp.add_argument("checkpoint", metavar="RUN_DIR", help="an output_dir, a final model dir or a checkpoint dir")
    sp.add_argument("out", metavar="OUT", help="directory to write (must not exist, or be empty)")

    sp = sub.add_parser(
        "plot",
        help="Draw a run's plots from its metrics.jsonl into RUN_DIR/plots (needs matplotlib).",
        description="Draw PNGs of a run from RUN_DIR/metrics.jsonl into RUN_DIR/plots: loss (train, smoothed, eval; "
        "skipped steps and rollbacks marked), learning rate, gradient norm and clip limit, throughput and fill rate, "
        "memory, time per step.",
    )
    sp.add_argument("run_dir", metavar="RUN_DIR", help="the output_dir of a training run")

    sp = with_config("config", "Print the resolved configuration (or every key with its help).")
    sp.add_argument("--keys", action="store_true", help="list every key, its default and what it means")
    sp.add_argument("--markdown", action="store_true", help="with --keys: as the Markdown table of docs/configuration.md")
    return p


def threads_wait_asleep() -> None:
    """Let torch's CPU threads (OpenMP: libgomp in torch's Linux builds) sleep while they wait for each other,
    unless the user chose (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``). By default a waiting thread spins first;
    on a machine whose cores other processes also use, the partner it waits for is often descheduled, and the
    spinning made steps many times slower (docs/benchmarks.md, "CPU threads on a shared machine"). libgomp
    reads the setting when torch loads, so it is set only before torch's import."""
    if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    threads_wait_asleep()
    try:
        rest, overrides = _split_overrides(argv)
        args = _parser().parse_args(rest)
        from densebatch import run  # imported late: `--help` stays fast

        return int(run.dispatch(args, overrides) or 0)
    except UserError as e:
        print(f"densebatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("densebatch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
