"""What ``eval`` and ``generate`` take from the run that trained the model: its tokenizer-defining settings and its prompt template.

A trained model answers for text made as its run made it, so these keys are the run's:
``data.tokenizer``, ``data.add_tokens``, ``data.add_special_tokens``, ``data.pad_id``,
``data.max_seq_len``, ``data.overlong``, ``data.clean``, each source's ``template``, ``fields``,
``prompt_format`` and ``loss_on``, ``batching.mode`` and ``model.*`` (and for a masked LM
``batching.mlm_probability`` and ``seed``: which tokens are masked). A configuration given to
``densebatch eval`` chooses *which* data to score (``data.path``, ``data.sources`` and their paths,
names, weights and formats, ``data.eval_path``, ``data.eval_fraction``, ``data.format``,
``data.cache_dir``, ``data.default``, text splitting) and *how* (batching, eval, device, precision);
``eval_view`` gives the configuration that is used and every run-owned key the given one sets
otherwise (the command prints one line for each and uses the run's value).

A source of the given data takes the template of the run's source of the same name, else of the
same position (as many sources as the run had), else the run's only template; a run that mixed
templates and data matching none of its sources is refused. The run's added tokens are requested
in the run's order, so the tokenizer has the run's ids even when the given data lacks the source
that added them (chatml's markers).

``prompt_for`` renders ``generate``'s prompt with the run's template: alpaca (the text as the
instruction), chatml (a user turn, then the assistant's header), chat_template (the tokenizer's own,
``add_generation_prompt=True``), custom (the text in ``data.prompt_format``'s one field, or a JSON
object of its fields), raw (the text). A mixture whose templates differ uses its first source's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from densebatch.config import DataConfig, RunConfig, prompt_fields
from densebatch.data.prepare.chat_template import ChatTemplate, ChatTemplateError
from densebatch.data.prepare.clean import Cleaner
from densebatch.data.prepare.source_configs import source_configs
from densebatch.data.prepare.sources import detect_format
from densebatch.data.prepare.templates import RecordError, prompt_text
from densebatch.data.prepare.vocab import requested_tokens
from densebatch.errors import DataError, UserError

# Keys of data.* that decide the tokenizer and the documents' length and text (the template keys are per source).
TOKENIZER_KEYS = ("tokenizer", "add_tokens", "add_special_tokens", "pad_id", "max_seq_len", "overlong", "clean")
TEMPLATE_KEYS = ("template", "fields", "prompt_format", "loss_on")

Difference = tuple[str, Any, Any]  # (key, the given value, the run's value)


def _leaves(value: Any, key: str) -> dict[str, Any]:
    """``{key.sub.key: value}`` of a config value (sections flattened to their fields)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{key}.{k}"))
        return out
    return {key: value}


def differences(key: str, given: Any, run: Any) -> list[Difference]:
    """Each leaf of ``key`` whose given value is not the run's."""
    g, r = _leaves(given, key), _leaves(run, key)
    return [(k, g.get(k), r.get(k)) for k in dict.fromkeys([*r, *g]) if g.get(k) != r.get(k)]


def note_lines(diffs: list[Difference], who: str = "CONFIG") -> list[str]:
    """One line per difference, as the commands print them on stderr."""
    return [f"densebatch: note: {who} sets {k}={g!r} but the run used {r!r}: using the run's" for k, g, r in diffs]


def _template_of(c: DataConfig) -> str:
    """The template keys of a single-source DataConfig, comparable and hashable."""
    return repr(tuple(getattr(c, k) for k in TEMPLATE_KEYS))


def _run_templates(given: DataConfig, run: DataConfig) -> list[DataConfig]:
    """For each source of ``given``, the run's source (a single-source DataConfig) whose template it takes."""
    run_parts, given_parts = source_configs(run), source_configs(given)
    if len({_template_of(c) for _, c in run_parts}) == 1:
        return [run_parts[0][1]] * len(given_parts)
    by_name = dict(run_parts)
    if all(name in by_name for name, _ in given_parts):
        return [by_name[name] for name, _ in given_parts]
    if len(given_parts) == len(run_parts):
        return [c for _, c in run_parts]
    mixed = ", ".join(f"{name}: {c.template}" for name, c in run_parts)
    names = ", ".join(name for name, _ in given_parts)
    raise UserError(
        f"the run mixed sources with different templates ({mixed}); the given data ({names}) matches none of them by "
        f"name and has not {len(run_parts)} sources to match by position: give data.sources named as the run's, or "
        "leave CONFIG out to score the run's own data"
    )


def _data_view(given: DataConfig, run: DataConfig) -> tuple[DataConfig, list[Difference]]:
    diffs = [d for k in TOKENIZER_KEYS for d in differences(f"data.{k}", getattr(given, k), getattr(run, k))]
    assigned = _run_templates(given, run)
    for i, ((_, part), used) in enumerate(zip(source_configs(given), assigned)):
        prefix = f"data.sources[{i}]" if given.sources else "data"
        diffs += [d for k in TEMPLATE_KEYS for d in differences(f"{prefix}.{k}", getattr(part, k), getattr(used, k))]
    # The run's added tokens in the run's order (chatml's markers first when a run source used chatml):
    # the same ids whatever templates the given data's sources take.
    tokens = requested_tokens(run)
    owned = {k: getattr(run, k) for k in TOKENIZER_KEYS} | {
        "add_special_tokens": [t for t, special in tokens if special],
        "add_tokens": [t for t, special in tokens if not special],
    }
    if given.sources:
        sources = [dataclasses.replace(s, **{k: getattr(a, k) for k in TEMPLATE_KEYS}) for s, a in zip(given.sources, assigned)]
        data = dataclasses.replace(given, **owned, **{k: getattr(run, k) for k in TEMPLATE_KEYS}, sources=sources)
    else:
        data = dataclasses.replace(given, **owned, **{k: getattr(assigned[0], k) for k in TEMPLATE_KEYS})
    return data, diffs


def eval_view(given: RunConfig, run: RunConfig) -> tuple[RunConfig, list[Difference]]:
    """The configuration ``eval`` uses: ``given`` with the run's own keys (this module's docstring lists them), and each
    run-owned key ``given`` sets otherwise."""
    data, diffs = _data_view(given.data, run.data)
    diffs += differences("batching.mode", given.batching.mode, run.batching.mode)
    diffs += differences("model", given.model, run.model)
    batching = dataclasses.replace(given.batching, mode=run.batching.mode)
    seed = given.seed
    if run.batching.mode == "mlm":  # which tokens are masked: the run's draw, so its own evaluations compare
        diffs += differences("batching.mlm_probability", given.batching.mlm_probability, run.batching.mlm_probability)
        diffs += differences("seed", given.seed, run.seed)
        batching, seed = dataclasses.replace(batching, mlm_probability=run.batching.mlm_probability), run.seed
    return dataclasses.replace(given, data=data, batching=batching, model=run.model, seed=seed), diffs


def same_documents(a: DataConfig, b: DataConfig) -> bool:
    """Whether ``a`` and ``b`` read the same data the same way (the cache directory aside)."""
    return dataclasses.replace(a, cache_dir="") == dataclasses.replace(b, cache_dir="")


# ------------------------------------------------------------------------------------- generate
def _prompt_template(data: DataConfig) -> tuple[DataConfig, str | None]:
    """The single-source DataConfig whose template makes prompts, and a note when the run's sources differ."""
    parts = source_configs(data)
    name, first = parts[0]
    if first.path is not None:
        try:
            if detect_format(first.path, first.format) == "text":  # plain text was trained as raw text
                first = dataclasses.replace(first, template="raw")
        except DataError:
            pass  # the file is gone and its name says nothing: the template as configured
    note = None
    if len({_template_of(c) for _, c in parts}) > 1:
        mixed = ", ".join(f"{n}: {c.template}" for n, c in parts)
        note = (
            f"densebatch: note: the run's sources use different templates ({mixed}); the prompt goes through the "
            f"first source's ({name}: {first.template}); --raw sends it verbatim"
        )
    return first, note


def _custom_record(text: str, fmt: str, clean) -> dict:
    names = prompt_fields(fmt)
    if not names:
        raise UserError(f"--prompt: data.prompt_format {fmt!r} names no field to put the prompt in; use --raw")
    if len(names) == 1:
        return {names[0]: clean(text)}
    example = json.dumps({n: "..." for n in names})
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise UserError(
            f"--prompt: the run's data.prompt_format names the fields {', '.join(names)}: give --prompt as a JSON "
            f"object of them, e.g. '{example}'"
        )
    missing, unknown = [n for n in names if n not in record], sorted(set(record) - set(names))
    if missing or unknown:
        what = "; ".join(
            x for x in (missing and f"missing {', '.join(missing)}", unknown and f"unknown {', '.join(unknown)}") if x
        )
        raise UserError(f"--prompt: {what}; the run's data.prompt_format names the fields {', '.join(names)}")
    return {n: clean(v) if isinstance(v, str) else v for n, v in record.items()}


def prompt_for(text: str, data: DataConfig, tok) -> tuple[str, str | None]:
    """(the prompt the run's template makes of ``text``, a note to print or None). The run's cleaning
    applies to the text, as it did to every field value the model was trained on."""
    cfg, note = _prompt_template(data)
    if cfg.template == "raw":
        return text, note
    clean = Cleaner(cfg.clean).transform
    f = cfg.fields
    if cfg.template == "chat_template":
        try:
            return ChatTemplate.of(tok).render([{"role": "user", "content": clean(text)}], add_generation_prompt=True), note
        except ChatTemplateError as e:
            raise UserError(f"--prompt: {e.message}") from None
    # A placeholder response: prompt_text returns everything before the first response segment.
    if cfg.template == "alpaca":
        record = {f.instruction: clean(text), f.input: "", f.output: "-"}
    elif cfg.template == "chatml":
        record = {f.messages: [{f.role: "user", f.content: clean(text)}, {f.role: "assistant", f.content: "-"}]}
    else:  # custom: load_config checked that prompt_format is set
        record = {**_custom_record(text, cfg.prompt_format or "", clean), f.output: "-"}
    try:
        return prompt_text(record, cfg), note
    except RecordError as e:
        raise UserError(f"--prompt: {e.message}") from None
