"""``python final_driver.py ARGS...`` is ``densebatch ARGS...`` with ``final/`` split into files of at most 40 kB.

Run under torchrun by tests/cli/test_distributed.py, so that a tiny Hugging Face model's streamed ``final/``
takes the layout ``save_pretrained`` gives a large model (``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``). No production hook: the module constant is set here.
"""

from __future__ import annotations

import sys

import densebatch.run.final as final
from densebatch.cli import main

final.SHARD_BYTES = 40_000

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
