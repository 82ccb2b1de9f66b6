"""Paged optimizers beyond one GPU: FSDP2 (DTensor) shards, DDP replicas, DCP resume state.

Modules:
    launch: process group from torchrun's environment; a guarded torchrun runner.
    parallelize: FSDP2 per block or DDP over the default process group.
    dcp: save/resume model + optimizer state with torch.distributed.checkpoint (any rank count).
    selfcheck: ``torchrun … -m tightfit.distributed.selfcheck``: paged vs torch AdamW.

The DTensor helpers the optimizers need live with them (:mod:`tightfit.optim.dtensor`); the
job ``tightfit train`` runs under torchrun is :mod:`tightfit.train.job`.
"""
