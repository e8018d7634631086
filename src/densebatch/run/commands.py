"""The short commands that import torch: analyze, eval, generate, export and config (prepare and inspect: ``data_commands``)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from densebatch.analyze import analyze_main, analyze_prepared, read_lengths
from densebatch.atomic import staged_dir
from densebatch.config import RunConfig, config_from_dict, describe, load_config, to_dict, with_overrides
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.rules import check_batching
from densebatch.data.prepare.cache import LEARNED_TOKENIZER
from densebatch.data.prepare.tokenizers import has_tokenizer_files, load_data_tokenizer, load_tokenizer
from densebatch.errors import UserError
from densebatch.model import GPT, build_model, load_model
from densebatch.model import generate as generate_ids
from densebatch.model.export import export_gpt_as_hf
from densebatch.model.generate import check_sampling
from densebatch.model.hf.lora import is_adapter_dir, load_adapter
from densebatch.run.auto import resolved_budget
from densebatch.run.build import eval_loader, resolve_config, usable_device
from densebatch.run.data_commands import prepare_data
from densebatch.run.demo import DEMO_OVERRIDES
from densebatch.run.layout import CHECKPOINT_DIR, FINAL_DIR, FINAL_STATE
from densebatch.run.owned import eval_view, note_lines, prompt_for, same_documents
from densebatch.train.checkpoint.manager import Checkpoint, checkpoint_step, latest_valid, load_checkpoint
from densebatch.train.evaluate import evaluate as evaluate_batches


def analyze_command(cfg: RunConfig, args) -> int:
    settings = PlanSettings.from_config(cfg.batching)
    kw = dict(json_out=args.json, dump_plan=args.dump_plan, strategy=args.strategy, plot=args.plot)
    if args.strategy:  # that strategy alone (and the plan --dump-plan writes)
        kw["strategies"] = [args.strategy]
    if args.lengths:
        print(analyze_main(read_lengths(args.lengths), settings=settings, seed=cfg.seed, **kw))
    else:  # prepared documents: per source too, with the mixture's weights
        print(analyze_prepared(prepare_data(cfg.data, cfg.seed), settings, cfg.seed, **kw))
    return 0


CONFIG_DOC_HEADER = """# Configuration

One YAML file per run maps onto nested dataclasses (`src/densebatch/config/`, each field documented
in place). Any key can be overridden on the command line as `--section.key=value`; unknown keys,
wrong types and invalid values stop the run with a message naming the key (exit code 2).
`densebatch config --keys` prints this table; `densebatch config CONFIG` prints a resolved configuration.
No key is silently ignored: each declares the settings under which it takes effect
(`src/densebatch/config/applies.py`), and one set away from its default where it has none is refused in one
line naming it and the key it depends on (`model.path` with `model.kind: gpt`), or, where ignoring it is
harmless (the settings of a feature switched off, another batching strategy's knob), noted on stderr.
With no config, `densebatch train` runs the embedded default (`configs/default.yaml` writes it out).
This page is generated: `densebatch config --keys --markdown > docs/configuration.md`.
"""


def demo_line() -> str:
    """The defaults are those of a config file (and of a run on your own data); what the demo sets on top."""
    keys = ", ".join(f"`{o[2:]}`" for o in DEMO_OVERRIDES)
    return (
        "The defaults below are those of a config file, and of a command line that names data of its own; the demo "
        f"(no config, no data.path / data.sources) sets these on top: {keys} (`densebatch config` prints it resolved)."
    )


def config_markdown() -> str:
    rows = "".join(f"| `{k}` | `{d}` | {h.replace('|', '/')} |\n" for k, d, h in describe())
    return CONFIG_DOC_HEADER + "\n" + demo_line() + "\n\n| key | default | meaning |\n|---|---|---|\n" + rows


def config_command(cfg: RunConfig, args) -> int:
    if args.keys and args.markdown:
        print(config_markdown(), end="")
    elif args.keys:
        print(demo_line().replace("`", "") + "\n")
        width = max(len(k) for k, _, _ in describe())
        for key, default, help_ in describe():
            print(f"{key:<{width}}  {default:<18}  {help_}")
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


# ----------------------------------------------------------------------------- trained models
def _final_step(final: Path) -> int | None:
    try:
        return int(json.loads((final / FINAL_STATE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_saved_model(d: Path) -> bool:
    """A final model: config.json (a whole model), or a LoRA run's adapter_config.json."""
    return (d / "config.json").is_file() or is_adapter_dir(d)


def find_model_dir(path: str | Path) -> tuple[str, Path, str]:
    """What ``--checkpoint DIR`` names: ("final" | "checkpoint", dir, a note saying which weights).

    A saved model (config.json) or a checkpoint (manifest.json) is itself; an output_dir resolves to
    the newer of its final model and its newest valid checkpoint (a resumed run interrupted after its
    first finish leaves a final/ older than its checkpoints: those are scored, and the note says so)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"--checkpoint {path}: no such directory")
    if (p / "manifest.json").is_file():
        return "checkpoint", p, f"checkpoint {p}"
    if is_saved_model(p):
        return "final", p, f"saved model {p}"
    final = p / FINAL_DIR if is_saved_model(p / FINAL_DIR) else None
    ckpt = latest_valid(p / CHECKPOINT_DIR) if (p / CHECKPOINT_DIR).is_dir() else None
    if final is not None and ckpt is not None:
        final_step, ckpt_step = _final_step(final), checkpoint_step(ckpt)
        if final_step is None or ckpt_step > final_step:
            return "checkpoint", ckpt, f"checkpoint {ckpt} (step {ckpt_step}; newer than {final}, step {final_step})"
    if final is not None:
        return "final", final, f"final model {final} (step {_final_step(final)})"
    if ckpt is not None:
        return "checkpoint", ckpt, f"checkpoint {ckpt} (step {checkpoint_step(ckpt)}; no final model yet)"
    raise UserError(
        f"--checkpoint {path}: neither a saved model (config.json) nor a checkpoint (manifest.json), "
        f"nor an output_dir holding {FINAL_DIR}/ or {CHECKPOINT_DIR}/"
    )


def open_trained(kind: str, d: Path) -> tuple[RunConfig | None, Checkpoint | None]:
    """(the configuration the run saved with these weights or None, the checkpoint's model and
    configuration when ``d`` is one): final/config.yaml, or the checkpoint's own, read (and verified) once."""
    if kind == "final":
        return (load_config(d / "config.yaml", saved=True) if (d / "config.yaml").is_file() else None), None
    ckpt = load_checkpoint(d, parts=("model", "extra"))
    saved = (ckpt.extra_state or {}).get("config")
    return (config_from_dict(saved, saved=True) if saved else None), ckpt


def build_trained(kind: str, d: Path, run_cfg: RunConfig | None, ckpt: Checkpoint | None):
    """(model, tokenizer, the directory holding the tokenizer's files or None) of the weights in ``d``;
    ``run_cfg``: how its run built them (required for a checkpoint)."""
    if kind == "final":
        tokenizer = load_tokenizer(d)
        model_cfg = (run_cfg or RunConfig()).model  # how the run loaded it (Gemma 2: eager attention)
        if is_adapter_dir(d):  # a LoRA run's final: the adapter, on the base model its run trained
            model = load_adapter(d, model_cfg, tokenizer.vocab_size)
        else:
            model = load_model(d, attn_implementation=model_cfg.attn_implementation)
        return model, tokenizer, d
    if run_cfg is None or ckpt is None:
        raise UserError(f"{d}: the checkpoint carries no configuration; pass the run's CONFIG")
    tokenizer_dir = None
    if run_cfg.data.tokenizer.startswith("bpe:"):  # a learned tokenizer lives with the prepared documents
        prepared = prepare_data(run_cfg.data)
        tokenizer, tokenizer_dir = prepared.tokenizer, prepared.cache_dir / LEARNED_TOKENIZER
    else:
        tokenizer = load_data_tokenizer(run_cfg.data)  # with the tokens the run added (chatml's markers, add_tokens)
    # base_vocab_size: under LoRA the added tokens' rows are modules of their own (their state's keys)
    model = build_model(
        run_cfg.model, vocab_size=tokenizer.vocab_size, base_vocab_size=tokenizer.base_vocab_size, task=run_cfg.batching.mode
    )
    model.load_state_dict(ckpt.model_state)
    return model, tokenizer, tokenizer_dir


def load_trained(path: str | Path, cfg: RunConfig | None = None):
    """(model, tokenizer, run config, which weights) from a final model dir, a checkpoint or an output_dir.
    The run's own configuration decides; ``cfg`` only stands in where the weights carry none."""
    kind, d, which = find_model_dir(path)
    saved, ckpt = open_trained(kind, d)
    run_cfg = saved or cfg
    model, tokenizer, _ = build_trained(kind, d, run_cfg, ckpt)
    return model, tokenizer, run_cfg, which


def _given_config(args, overrides: list[str], saved: RunConfig | None, d: Path) -> RunConfig:
    """The configuration the eval command was given: CONFIG (with overrides), else the run's own with the overrides."""
    if args.config is not None:
        return resolve_config(args.config, overrides)
    if saved is None:
        raise UserError(f"{d} carries no run configuration (config.yaml): pass the run's CONFIG")
    cfg = config_from_dict(with_overrides(to_dict(saved), overrides), saved=True)
    check_batching(cfg.batching)
    return cfg


def _eval_documents(cfg: RunConfig, run_cfg: RunConfig | None, tok, tokenizer_dir: Path | None):
    """The prepared documents of ``cfg.data``, tokenised by the run's tokenizer: a ``bpe:N`` tokenizer
    was learned from the run's training text, so other data is read with the learned one's files."""
    data = cfg.data
    if data.tokenizer.startswith("bpe:") and run_cfg is not None and not same_documents(data, run_cfg.data):
        if tokenizer_dir is None or not has_tokenizer_files(tokenizer_dir):
            raise UserError(f"the run's tokenizer ({data.tokenizer}, learned from its training data) is not on disk")
        data = replace(data, tokenizer=str(tokenizer_dir))
    prepared = prepare_data(data)
    if prepared.tokenizer.fingerprint() != tok.fingerprint():  # never a loss over another tokenizer's ids
        raise UserError(
            f"data.tokenizer {data.tokenizer} ({prepared.tokenizer.vocab_size} ids) is not the tokenizer saved with the "
            f"model ({tok.name}, {tok.vocab_size} ids): set data.tokenizer to the model's"
        )
    return prepared


def eval_command(args, overrides: list[str]) -> int:
    """``densebatch eval [CONFIG] --checkpoint DIR``: the run's own configuration, or CONFIG choosing the data
    and the batching while the run's tokenizer, template and model stay (``run/owned.py``), each difference noted."""
    kind, d, which = find_model_dir(args.checkpoint)
    saved, ckpt = open_trained(kind, d)
    cfg = _given_config(args, overrides, saved, d)
    if saved is not None:
        cfg, diffs = eval_view(cfg, saved)
        for line in note_lines(diffs, "CONFIG" if args.config is not None else "an override"):
            print(line, file=sys.stderr)
        if cfg.batching.max_tokens_per_batch == "auto" and saved.batching.max_tokens_per_batch != "auto":
            cfg = replace(cfg, batching=replace(cfg.batching, max_tokens_per_batch=saved.batching.max_tokens_per_batch))
    elif kind == "final" and has_tokenizer_files(d) and cfg.data.tokenizer != str(d):  # a bare model directory
        print(f"densebatch: note: CONFIG sets data.tokenizer={cfg.data.tokenizer!r}: using the model's own, {d}", file=sys.stderr)
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(d)))
    cfg = resolved_budget(cfg)  # it plans batches: an `auto` budget is the one a run found
    model, tok, tokenizer_dir = build_trained(kind, d, saved or cfg, ckpt)
    prepared = _eval_documents(cfg, saved, tok, tokenizer_dir)
    if prepared.eval is None:
        d = cfg.data
        why = (
            "no document of its eval_path was kept (every record skipped, or none with a loss token; densebatch "
            "prepare with the same settings counts why)"
            if d.eval_path or any(s.eval_path for s in d.sources)
            else "set data.eval_path or data.eval_fraction > 0"
        )
        raise UserError(f"there is no evaluation split: {why}")
    device = usable_device(cfg.train.device)
    loader = eval_loader(cfg, prepared.eval)  # full-context rows, as the evaluations of a run (run/build.py)
    result = evaluate_batches(
        model.to(device),
        loader.iter_epoch(0, cfg.eval.max_batches),
        device=device,
        precision=cfg.train.precision,
        source_names=prepared.eval.source_names,
    )
    out = result.as_dict() | {"strategy": cfg.batching.strategy, "checkpoint": str(args.checkpoint), "weights": which}
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"eval loss {result.loss:.6f}  ppl {result.ppl:.4f}  over {result.tokens} loss tokens "
            f"({result.batches} batches, strategy {cfg.batching.strategy}); weights: {which}"
        )
        if result.masked_accuracy is not None:
            print(f"masked-token accuracy {result.masked_accuracy:.4f} (argmax right, over the masked tokens)")
        for name, loss in (result.loss_by_source or {}).items():
            print(f"  source {name}: loss {loss:.6f} over {result.tokens_by_source[name]} loss tokens")
    return 0


def generate_command(args) -> int:
    """``densebatch generate``: greedy (or sampled) continuation of --prompt, rendered with the run's template
    (``run/owned.py``: alpaca, chatml, chat_template, custom) unless --raw."""
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens: expected a positive integer")
    check_sampling(args.temperature, args.top_k, ("--temperature", "--top-k"))
    kind, d, _ = find_model_dir(args.checkpoint)
    run_cfg, ckpt = open_trained(kind, d)
    model, tok, _ = build_trained(kind, d, run_cfg, ckpt)
    if getattr(model, "task", "causal") == "mlm":
        raise UserError(
            f"{d}: an encoder masked LM (batching.mode mlm) predicts masked tokens and generates no continuation; "
            "score it with densebatch eval, or load final/ with AutoModelForMaskedLM"
        )
    prompt, note = args.prompt, None
    if not args.raw and run_cfg is None:
        note = f"densebatch: note: {d} carries no run configuration (config.yaml): the prompt goes in as written"
    elif not args.raw:
        prompt, note = prompt_for(args.prompt, run_cfg.data, tok)
    if note:
        print(note, file=sys.stderr)
    model.eval()
    with torch.no_grad():
        new = generate_ids(
            model, tok.encode(prompt), args.max_new_tokens, temperature=args.temperature, eos_id=tok.eos_id, top_k=args.top_k
        )
    print(tok.decode([i for i in new if i != tok.eos_id]))
    return 0


def export_command(args) -> int:
    """``densebatch export RUN_DIR OUT``: a Hugging Face model directory with the run's tokenizer."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not empty; export writes a new directory")
    model, tok, _, which = load_trained(args.checkpoint)
    with staged_dir(out) as tmp:
        if isinstance(model, GPT):
            export_gpt_as_hf(model, tmp, eos_id=tok.eos_id, pad_id=tok.pad_id)
        else:
            model.save_merged(tmp)  # Hugging Face models: save_pretrained (LoRA adapters merged)
        tok.save(tmp)
    auto = "AutoModelForMaskedLM" if getattr(model, "task", "causal") == "mlm" else "AutoModelForCausalLM"
    print(f"exported {which} to {out} ({auto} / AutoTokenizer.from_pretrained load it)")
    return 0
