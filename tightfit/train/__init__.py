"""tightfit.train: the ``tightfit train`` and ``tightfit export`` jobs.

Here:
    train_command: ``tightfit train``'s command line, generated from the option dataclasses.
    run_options: ``RunConfig``, ``TrainOptions``, ``DataOptions``: every option of a run (the
        defaults are the QLoRA recipe).
    validate: the checks that need the machine or the file system, made first.
    run_setup: ``setup(cfg)``: every check, then model, data, optimizer and output folder (a
        ``Run``).
    loop: ``train(cfg)`` = ``setup`` → ``run_steps`` → ``finish`` (report, plots, adapter).
    step: one step: forward + backward (retried once after an OOM), the update held against
        Ctrl-C, the step's record.
    data: ``--data`` through ``datasets``: formats, labels, examples, batches (a package).
    schedule, eval: the learning rate of each step; the eval loss.
    builtin: the built-in small Llama-architecture model (random weights, from a config).
    resume: the resume state on disk (atomic saves, ``LATEST``, bit-exact resume, the saved
        configuration a ``--resume DIR`` continues with).
    memory, summary, predicted: the run's memory figures, its part of the report, and what
        ``tightfit plan`` predicts for the same setup.
    plots: the loss curve, the memory timeline, memory per rank.
    job: what differs under torchrun (DDP/FSDP2 wrapping, batch rows, DCP saves, per-rank
        figures).
    export: ``tightfit export``: the adapter, and a merged HF model folder.

May import every folder below it (measure … planner, distributed); only :mod:`tightfit.cli`
and the public API sit above. Entry point: :func:`tightfit.train.loop.train` (``tightfit
train`` on the command line).
"""
