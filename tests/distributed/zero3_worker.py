"""Worker for ``test_zero3_checkpoint.py``: FSDP2 ZeRO-3 + a checkpoint plan, vs torch AdamW.

Run under torchrun (the test launches it on 2 gloo ranks)::

    torchrun --nproc_per_node 2 tests/distributed/zero3_worker.py OUT POLICY [POLICY ...]

For each checkpoint policy, every rank builds the selfcheck's tiny Llama, installs the plan,
shards it with ``TrainJob(..., reshard_after_forward=True).wrap`` (FSDP2 ZeRO-3: every
parameter a dim-0 shard, each block's gathered parameters freed after its forward), trains it with
``torch.optim.AdamW`` on its rows of the selfcheck's global batches. Rank 0 writes
``<policy>.pt`` (the full parameters), ``reference.pt`` (one process, no checkpointing, whole
batches) and ``report.json`` (per policy: hook counts, what was sharded, what was unsharded
while the recompute ran).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import tightfit.checkpoint as ck
from tightfit.distributed import launch, selfcheck
from tightfit.optim.dtensor import is_dtensor
from tightfit.train.job import TrainJob


def _run(opts: selfcheck.CheckOptions, policy: str, info: launch.DistInfo) -> dict:
    model = selfcheck.tiny_llama(opts.seed, info.device)
    plan = ck.enable(model, policy)
    blocks = list(model.model.layers)
    # as ``tightfit train --fsdp`` wraps it (fully_shard per decoder layer, then the root)
    TrainJob(info, "fsdp", reshard_after_forward=True).wrap(model)

    def probe() -> torch.nn.Parameter:  # FSDP2 swaps the module attribute: read it each time
        return blocks[0].self_attn.q_proj.weight

    seen = {"pre_hooks": 0, "in_backward": 0, "local_in_backward": []}
    phase = {"backward": False}

    def pre(_m: torch.nn.Module, _args: object) -> None:
        # Runs after FSDP2's own pre-forward hook (registered first, by fully_shard), so in the
        # recompute the block's parameters are already gathered here.
        seen["pre_hooks"] += 1
        if phase["backward"]:
            seen["in_backward"] += 1
            seen["local_in_backward"].append(not is_dtensor(probe()))

    blocks[0].register_forward_pre_hook(pre)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    per = opts.batch // info.world_size
    after_forward = []
    for step in range(opts.steps):
        ids = selfcheck.global_batch(opts, step, info.device)[info.rank * per : (info.rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
        after_forward.append(is_dtensor(probe()))  # resharded after forward: ZeRO-3
        phase["backward"] = True
        loss.backward()
        phase["backward"] = False
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    final = selfcheck.full_params(model)
    if info.is_main:
        torch.save(final, os.path.join(opts.out, f"{policy.replace(':', '_')}.pt"))
    return {
        "checkpointed_blocks": plan.checkpointed_blocks,
        "sharded": all(is_dtensor(p) for p in model.parameters()),
        "resharded_after_forward": all(after_forward),
        "steps": opts.steps,
        **seen,
    }


def main(argv: list[str]) -> int:
    out, policies = argv[0], argv[1:]
    opts = selfcheck.CheckOptions(out=out, optim="torch", steps=3, save_at=1)
    info = launch.init_from_env(device="cpu")
    report = {p: _run(opts, p, info) for p in policies}
    if info.is_main:
        selfcheck.reference_params(opts, info.device)  # writes reference.pt
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
    launch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
