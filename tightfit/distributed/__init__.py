"""Paged optimizers beyond one GPU: FSDP2 (DTensor) shards, DDP replicas, DCP checkpoints.

Modules:
    launch: process group from torchrun's environment; a guarded torchrun runner.
    parallelize: FSDP2 per block or DDP over the default process group.
    dtensor: local-shard helpers an optimizer uses to page and export DTensor state.
    dcp: save/resume model + optimizer with torch.distributed.checkpoint (any rank count).
    selfcheck: ``torchrun … -m tightfit.distributed.selfcheck``: paged vs torch AdamW.
    training: ``TrainJob``, what ``tightfit train`` asks when launched by torchrun.
    plots: per-rank memory plot of a distributed run.
"""
