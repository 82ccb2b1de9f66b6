"""tightfit.planner: will it fit? Shapes and presets, the memory model, the ladder, verify.

Predicts, in bytes, every piece of device memory one LoRA/QLoRA step needs, for a ladder of
configurations, before anything is loaded.

Here:
    shapes, presets, configs: ``ModelShape`` per family; built-in presets; a shape from a
        ``config.json`` (``load_shape``).
    train_setup: ``TrainSetup``, one way to fine-tune (what the planner is asked about).
    estimate: the memory model: bytes of every piece of a step.
    activations, attention, moe: activation bytes per layer, per family, per MoE layer.
    peak, host: a checkpoint plan's activation peak, device and host; the pinned host side.
    work, speed: matmul work per token; the estimated slowdown of each row.
    paged_weights: how many layers keep their NF4 weights on the device, the rest streamed.
    ladder: ``plan(...)``: the configurations, each predicted piece by piece.
    max_length: ``--max-seq``: the longest sequence (largest batch) each row fits.
    ranks: ``--gpus N``: one rank's bytes under FSDP2 (or DDP), the fewest GPUs that fit.
    table: ``PlanReport`` and ``Row``, and the table printed of them (text or ``--json``).
    train_args: the ``tightfit train`` options that select a planned row.
    verify, mechanisms: ``--verify``, one real step per row, measured beside the prediction.
    plan_command: ``tightfit plan``'s command line.

May import measure, model, integrity, tiers, loss, checkpoint, paging, pressure, optim, qlora
and report (``verify`` builds real models with qlora and optim). Entry point:
:func:`tightfit.plan` (:func:`tightfit.planner.ladder.plan`; ``tightfit plan`` on the
command line).
"""
