"""Run configuration: one YAML file mapped onto nested, documented dataclasses, plus CLI overrides.

Every field carries its documentation in ``metadata["help"]`` (shown by ``densebatch config``); a
field whose value is one of a fixed set is typed ``Literal[...]``, the one place its choices live. ``load_config`` reads a YAML file,
applies ``--section.key=value`` overrides and validates everything; any mistake raises
``ConfigError`` naming the key and what was expected. No ``exec``, no class names in strings.

Modules: ``field`` (the documented field), ``data_sections`` (data, batching), ``model_section``
(model, LoRA), ``run_sections`` (train and its optimizer, batch_schedule, guard and health sub-sections,
eval, checkpoint, finder, ``RunConfig``), ``checks`` (cross-field rules), ``moved`` (keys that moved:
refused with their new name; read at their new place from configurations runs saved), ``loading``
(YAML and overrides onto the sections; the key table ``densebatch config --keys`` prints).
Import from ``densebatch.config``: the names below are its interface.
"""

from __future__ import annotations

from densebatch.config.checks import prompt_fields
from densebatch.config.data_sections import (
    BatchingConfig,
    CleanConfig,
    DataConfig,
    DefaultDataConfig,
    FieldsConfig,
    SourceConfig,
)
from densebatch.config.loading import (
    choices_of,
    config_fingerprint,
    config_from_dict,
    describe,
    load_config,
    note,
    parse_override,
    save_config,
    to_dict,
    with_overrides,
)
from densebatch.config.model_section import LoraConfig, ModelConfig
from densebatch.config.run_sections import (
    BatchScheduleConfig,
    CheckpointConfig,
    EvalConfig,
    FinderConfig,
    GroupScheduleConfig,
    GuardConfig,
    HealthConfig,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
)
from densebatch.errors import ConfigError

__all__ = [
    "BatchScheduleConfig",
    "BatchingConfig",
    "CheckpointConfig",
    "CleanConfig",
    "ConfigError",
    "DataConfig",
    "DefaultDataConfig",
    "EvalConfig",
    "FieldsConfig",
    "FinderConfig",
    "GroupScheduleConfig",
    "GuardConfig",
    "HealthConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SourceConfig",
    "TrainConfig",
    "choices_of",
    "config_fingerprint",
    "config_from_dict",
    "describe",
    "load_config",
    "note",
    "parse_override",
    "prompt_fields",
    "save_config",
    "to_dict",
    "with_overrides",
]
