"""tightfit.train: the ``tightfit train`` job.

Modules:
    options: ``TrainOptions`` and ``RunConfig``, every option of a run (the CLI is made from them).
    setup: every check, then model, data, optimizer and output folder: a ``Run``.
    loop: ``train(cfg)`` = ``setup`` → ``run_steps`` → ``finish`` (report, plots, adapter).
    resume: the resume state on disk (atomic saves, ``LATEST``, bit-exact resume).
    job: what differs under torchrun (DDP/FSDP2 wrapping, batch rows, DCP saves, per-rank figures).
    data, model, plots, cli: text and tokens, the built-in model, the pictures, the command line.
"""
