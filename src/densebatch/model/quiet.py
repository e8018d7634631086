"""Library output that is not the user's business, switched off around densebatch's own model loads and saves.

- ``quiet_progress``: transformers' progress bars ("Loading weights", "Writing model shards"; and the
  Hugging Face Hub's). A local directory loads in a moment, and the bars, on stderr and once per rank,
  stood in front of the run's own output. The setting is put back afterwards, so an application that
  embeds densebatch keeps its own; transformers' warnings (weights missing from a checkpoint, ...) still print.
- ``quiet_peft``: the same, and two warnings peft gives while it wraps a model, each ignored by its
  message, only there: the FutureWarning of ``PeftModel.__init__`` reading transformers'
  ``is_gradient_checkpointing``, which transformers 5 deprecated (for ``is_activation_checkpointing``);
  and "fan_in_fan_out is set to False but the target module is `Conv1D`" (GPT-2's projections), a
  setting densebatch does not expose, which peft then corrects per module itself.

Both import transformers only when used: without it they do nothing (its absence is reported by the caller).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# The messages (their starts) of the warnings above: transformers/modeling_utils.py (5.x), peft/tuners/lora/layer.py.
PEFT_DEPRECATION = "`is_gradient_checkpointing` is deprecated"
PEFT_LAYOUT = "fan_in_fan_out is set to (True|False) but the target module is"


@contextmanager
def quiet_progress() -> Iterator[None]:
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # the hub's bars too
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()  # the hub's too: put back as they were
            if hub_was_off:
                disable_progress_bars()


@contextmanager
def quiet_peft() -> Iterator[None]:
    with warnings.catch_warnings(), quiet_progress():
        warnings.filterwarnings("ignore", message=PEFT_DEPRECATION, category=FutureWarning)
        warnings.filterwarnings("ignore", message=PEFT_LAYOUT, category=UserWarning)
        yield
