"""tightfit.distributed: paged optimizers beyond one GPU: FSDP2 (DTensor) shards, DDP, DCP.

Here:
    launch: the process group from torchrun's environment (``init_from_env``, ``DistInfo``);
        a guarded torchrun runner and ``free_port``.
    parallelize: ``shard_model(model, "fsdp" | "ddp")``: FSDP2 per block (the 4-bit base
        sharded too, :mod:`tightfit.qlora.shardable`), or DDP.
    sharded_load: ``load_sharded(folder, ...)``: a QLoRA model built on meta and loaded shard
        by shard from safetensors, so no rank holds the whole model.
    dcp: save/resume model + optimizer state with torch.distributed.checkpoint (any rank count).
    selfcheck: ``torchrun … -m tightfit.distributed.selfcheck``: paged vs torch AdamW.
    qlora_check: ``torchrun … -m tightfit.distributed.qlora_check``: the sharded 4-bit base
        vs one process, resumes across rank counts, per-rank base bytes.

May import every folder up to planner (measure … optim, qlora, report, planner); it uses
model (``find_blocks``) and optim. The DTensor helpers the optimizers need live with them
(:mod:`tightfit.optim.dtensor`); the job ``tightfit train`` runs under torchrun is
:mod:`tightfit.train.job`. Entry point: :func:`tightfit.distributed.parallelize.shard_model`
(from the command line, ``torchrun … -m tightfit.cli train [--fsdp]``).
"""
