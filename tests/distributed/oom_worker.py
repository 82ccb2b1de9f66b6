"""Worker for ``test_rank_oom.py``: ``tightfit train`` on 2 ranks where rank 1 runs out of
memory inside step 3's forward (after its first block: rank 0 is left in the next
collective).

    torchrun --nproc_per_node 2 tests/distributed/oom_worker.py TRAIN-ARGS...
"""

from __future__ import annotations

import os
import sys

import torch

from tightfit.cli import main
from tightfit.model.blocks import find_blocks
from tightfit.train import step

FAIL_RANK, FAIL_STEP = 1, 3  # 1-based, as the message says


def _inject() -> None:
    original = step._forward_backward

    def forward_backward(run, micros):  # noqa: ANN001, ANN202
        if len(run.history) + 1 != FAIL_STEP or run.job.info.rank != FAIL_RANK:
            return original(run, micros)

        def oom(*_args: object) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(injected by the test)")

        handle = find_blocks(run.model)[1].register_forward_pre_hook(oom)
        try:
            return original(run, micros)
        finally:
            handle.remove()

    step._forward_backward = forward_backward


if __name__ == "__main__":
    assert os.environ.get("RANK") is not None, "run under torchrun"
    _inject()
    sys.exit(main(sys.argv[1:]))
