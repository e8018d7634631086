"""The one contract shared by data, model and train: a collated batch and the ignore index.

A ``Batch`` is what the data layer hands to everything downstream. Labels are already shifted
(``labels[r, t]`` is the target for ``input_ids[r, t]``); nothing downstream slices ``[:, 1:]``.

Positions carry document boundaries: ``positions[r, t] == 0`` marks the start of a document
(or of the padding run at the end of a row, which is treated as one more segment so that real
tokens never attend to padding and padding never attends to real tokens). A packed row with
documents of 3 and 2 tokens and 2 slots of padding looks like::

    input_ids  a0 a1 a2 b0 b1 P  P
    positions  0  1  2  0  1  0  1
    labels     a1 a2 -100 b1 E -100 -100      (E = b's end-of-text, the last token of b)

(with the end-of-text appended by prepare, the last *input* token of each document is its
end-of-text, whose target would be the next document; that target is -100.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # (rows, T) int64
    labels: Tensor  # (rows, T) int64; IGNORE_INDEX where no loss
    positions: Tensor  # (rows, T) int64; 0 at every document start
    num_loss_tokens: int  # labels != IGNORE_INDEX
    num_real_tokens: int  # non-padding tokens (fill rate, throughput)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_slots(self) -> int:
        """Token slots computed: rows × T (the denominator of the fill rate)."""
        return int(self.input_ids.numel())

    @property
    def fill_rate(self) -> float:
        return self.num_real_tokens / max(1, self.num_slots)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return replace(
            self,
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            positions=self.positions.pin_memory(),
        )


def document_ids(positions: Tensor) -> Tensor:
    """Segment index of every token, per row: increments at each ``positions == 0``. (rows, T)

    Two tokens may attend to each other only when they share a segment id (and causally).
    """
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1)
