"""``python collective_driver.py ARGS...`` is ``densebatch ARGS...`` counting FSDP2's gradient reductions.

Run under torchrun by tests/cli/test_distributed.py. Every call of FSDP2's ``foreach_reduce`` (one per
FSDP unit whose gradients are reduce-scattered after a backward) is counted; at exit each rank writes
its count to ``$DENSEBATCH_COUNTS/rank<RANK>.json``. No production hook: the function is wrapped here.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

from densebatch.cli import main

calls = {"foreach_reduce": 0}
inner = param_group.foreach_reduce


def counted(*args, **kwargs):
    calls["foreach_reduce"] += 1
    return inner(*args, **kwargs)


param_group.foreach_reduce = counted


@atexit.register
def write() -> None:
    out = Path(os.environ["DENSEBATCH_COUNTS"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
