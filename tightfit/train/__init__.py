"""tightfit.train: the ``tightfit train`` and ``tightfit export`` jobs.

Modules:
    options: ``TrainOptions``, ``DataOptions`` and ``RunConfig``, every option of a run (the CLI
        is made from them; the defaults are the QLoRA recipe).
    setup: every check, then model, data, optimizer and output folder: a ``Run``.
    loop: ``train(cfg)`` = ``setup`` → ``run_steps`` → ``finish`` (report, plots, adapter).
    data: ``--data`` through ``datasets``: formats, labels, examples, batches (a package).
    schedule, eval: the learning rate of each step; the eval loss.
    resume: the resume state on disk (atomic saves, ``LATEST``, bit-exact resume, the saved
        configuration a ``--resume DIR`` continues with).
    export: ``tightfit export``: the adapter, and a merged HF model folder.
    job: what differs under torchrun (DDP/FSDP2 wrapping, batch rows, DCP saves, per-rank figures).
    model, plots, cli: the built-in model, the pictures, the command line.
"""
