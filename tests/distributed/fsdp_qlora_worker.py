"""Worker for ``test_fsdp_qlora.py``: three scenarios of the QLoRA check in one 2-rank launch.

    torchrun --nproc_per_node 2 tests/distributed/fsdp_qlora_worker.py ONE TWO RESUMED OFFLOADED

``ONE`` holds the single-process run (its ``model/`` safetensors and ``saved/`` state).
Writes a fresh sharded run to ``TWO`` (saving after step 2), in ``RESUMED`` the
single-process saved state resumed on the 2 ranks, and in ``OFFLOADED`` a fresh run with the
shards on the host (FSDP2's CPUOffloadPolicy, ``--fsdp-offload``).
"""

from __future__ import annotations

import os
import sys

from tightfit.distributed import launch, qlora_check

# the test's stack beyond the check's defaults: offloaded checkpoint inputs, tiled MLPs
STACK = {"offload": "inputs", "mlp_tile": 8}


def main(argv: list[str]) -> int:
    one, two, resumed, offloaded = argv
    info = launch.init_from_env(device="cpu")
    model = os.path.join(one, "model")
    for out, resume_from, offload in ((two, "", False), (resumed, os.path.join(one, "saved"), False),
                                      (offloaded, "", True)):
        os.makedirs(out, exist_ok=True)
        qlora_check.run(qlora_check.QloraCheck(out=out, model=model, resume_from=resume_from,
                                               device="cpu", fsdp_offload=offload, **STACK),
                        info)  # fmt: skip
    launch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
