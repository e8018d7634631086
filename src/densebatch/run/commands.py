"""The short commands: prepare, inspect, analyze, eval, generate and config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml

from densebatch.analyze import analyze_main, analyze_prepared, read_lengths
from densebatch.atomic import staged_dir
from densebatch.config import RunConfig, config_from_dict, describe, load_config, to_dict
from densebatch.data.inspect import render_documents
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.prepare.pipeline import prepare as prepare_data
from densebatch.data.prepare.templates import prompt_text
from densebatch.data.prepare.tokenizers import load_data_tokenizer, load_tokenizer
from densebatch.errors import UserError
from densebatch.model import GPT, build_model, load_model
from densebatch.model import generate as generate_ids
from densebatch.model.export import export_gpt_as_hf
from densebatch.model.lora import is_adapter_dir, load_adapter
from densebatch.run.build import eval_loader
from densebatch.run.layout import CHECKPOINT_DIR, FINAL_DIR, FINAL_STATE
from densebatch.train.checkpoint import checkpoint_step, latest_valid, load_checkpoint
from densebatch.train.evaluate import evaluate as evaluate_batches
from densebatch.train.loop import resolve_device


def prepare_command(cfg: RunConfig, args) -> int:
    prepared = prepare_data(cfg.data, cfg.seed)
    print(prepared.summary)
    print(f"documents: {prepared.cache_dir}")
    return 0


def inspect_command(cfg: RunConfig, args) -> int:
    prepared = prepare_data(cfg.data)
    store = prepared.train if args.split == "train" else prepared.eval
    if store is None:
        raise UserError("there is no eval split: set data.eval_path or data.eval_fraction > 0")
    stop = min(len(store), args.start + max(0, args.num))
    print(render_documents(store, prepared.tokenizer, range(args.start, stop), color=sys.stdout.isatty()), end="")
    return 0


def analyze_command(cfg: RunConfig, args) -> int:
    settings = PlanSettings.from_config(cfg.batching)
    kw = dict(json_out=args.json, dump_plan=args.dump_plan, strategy=args.strategy, plot=args.plot)
    if args.lengths:
        print(analyze_main(read_lengths(args.lengths), settings, seed=cfg.seed, **kw))
    else:  # prepared documents: per source too, with the mixture's weights
        print(analyze_prepared(prepare_data(cfg.data, cfg.seed), settings, cfg.seed, **kw))
    return 0


CONFIG_DOC_HEADER = """# Configuration

One YAML file per run maps onto nested dataclasses (`src/densebatch/config/`, each field documented
in place). Any key can be overridden on the command line as `--section.key=value`; unknown keys,
wrong types and invalid values stop the run with a message naming the key (exit code 2).
`densebatch config --keys` prints this table; `densebatch config CONFIG` prints a resolved configuration.
With no config, `densebatch train` runs the embedded default (`configs/default.yaml` writes it out).
This page is generated: `densebatch config --keys --markdown > docs/configuration.md`.

| key | default | meaning |
|---|---|---|
"""


def config_markdown() -> str:
    rows = "".join(f"| `{k}` | `{d}` | {h.replace('|', '/')} |\n" for k, d, h in describe())
    return CONFIG_DOC_HEADER + rows


def config_command(cfg: RunConfig, args) -> int:
    if args.keys and args.markdown:
        print(config_markdown(), end="")
    elif args.keys:
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


def load_trained(path: str | Path, cfg: RunConfig | None = None):
    """(model, tokenizer, run config, which weights) from a final model dir, a checkpoint or an output_dir."""
    kind, d, which = find_model_dir(path)
    if kind == "final":
        tokenizer = load_tokenizer(d)
        saved_cfg = load_config(d / "config.yaml", saved=True) if (d / "config.yaml").is_file() else None
        model_cfg = (saved_cfg or cfg or RunConfig()).model  # how the run loaded it (Gemma 2: eager attention)
        if is_adapter_dir(d):  # a LoRA run's final: the adapter, on the base model its run trained
            model = load_adapter(d, model_cfg, tokenizer.vocab_size)
        else:
            model = load_model(d, attn_implementation=model_cfg.attn_implementation)
        return model, tokenizer, cfg or saved_cfg, which
    ckpt = load_checkpoint(d)
    saved = (ckpt.extra_state or {}).get("config")
    run_cfg = cfg or (config_from_dict(saved, saved=True) if saved else None)
    if run_cfg is None:
        raise UserError(f"{d}: the checkpoint carries no configuration; pass the run's CONFIG")
    if run_cfg.data.tokenizer.startswith("bpe:"):  # a learned tokenizer lives with the prepared documents
        tokenizer = prepare_data(run_cfg.data).tokenizer
    else:
        tokenizer = load_data_tokenizer(run_cfg.data)  # with the tokens the run added (chatml's markers, add_tokens)
    # base_vocab_size: under LoRA the added tokens' rows are modules of their own (their state's keys)
    model = build_model(run_cfg.model, tokenizer.vocab_size, tokenizer.base_vocab_size)
    model.load_state_dict(ckpt.model_state)
    return model, tokenizer, run_cfg, which


def eval_command(cfg: RunConfig, args) -> int:
    prepared = prepare_data(cfg.data)
    if prepared.eval is None:
        raise UserError("there is no evaluation split: set data.eval_path or data.eval_fraction > 0")
    model, _tok, _, which = load_trained(args.checkpoint, cfg)
    device = resolve_device(cfg.train.device)
    loader = eval_loader(cfg, prepared.eval)  # full-context rows, as the evaluations of a run (run/build.py)
    result = evaluate_batches(
        model.to(device),
        loader.iter_epoch(0),
        device=device,
        precision=cfg.train.precision,
        max_batches=cfg.eval.max_batches,
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
        for name, loss in (result.loss_by_source or {}).items():
            print(f"  source {name}: loss {loss:.6f} over {result.tokens_by_source[name]} loss tokens")
    return 0


def templated_prompt(text: str, cfg: RunConfig | None) -> str:
    """The prompt as the run's template would show it to the model (alpaca / chatml / custom)."""
    if cfg is None or cfg.data.template == "raw":
        return text
    f = cfg.data.fields
    # A placeholder response: prompt_text returns everything before the first response segment.
    if cfg.data.template == "alpaca":
        record = {f.instruction: text, f.input: "", f.output: "-"}
    elif cfg.data.template == "chatml":
        record = {f.messages: [{f.role: "user", f.content: text}, {f.role: "assistant", f.content: "-"}]}
    else:
        return text
    return prompt_text(record, cfg.data)


def generate_command(args) -> int:
    model, tok, run_cfg, _ = load_trained(args.checkpoint)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens: expected a positive integer")
    if args.temperature < 0:
        raise UserError("--temperature: expected 0 (greedy) or more")
    prompt = args.prompt if args.raw else templated_prompt(args.prompt, run_cfg)
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
    print(f"exported {which} to {out} (AutoModelForCausalLM / AutoTokenizer.from_pretrained load it)")
    return 0
