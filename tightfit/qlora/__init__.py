"""tightfit.qlora: ``tightfit.prepare``, the QLoRA stack on a causal LM.

Here:
    prepare: ``prepare(model_or_path, ...)``: check, freeze, 4-bit base, LoRA, chunked loss,
        the activation plan, in that order; ``PrepareInfo`` (``model.tightfit_info``).
    prepare_options: ``PrepareOptions`` and ``LoraOptions``, the typed options (the CLI's
        flags are made from them).
    quantize: the base's linear layers as bitsandbytes ``Linear4bit`` (NF4/FP4, double quant).
    experts: NF4 storage for MoE experts kept as fused 3-D weights, one expert at a time.
    expert_lora: LoRA on those 4-bit experts through peft's parameter targets.
    coverage: the notes on what stayed in full precision or without adapters.
    saved_quant_state: a prepared model's state dict loads back into its 4-bit layers.
    paged_base: ``enable_paged_base``: the 4-bit weights of all but the last K decoder
        layers wait on the next tier and stream in one layer ahead (``resident_layers``).
    shardable: ``ShardableLinear4bit``, a 4-bit layer whose codes and constants are
        parameters FSDP2 can shard (:mod:`tightfit.distributed.parallelize`).

May import measure, model, integrity, tiers, loss, checkpoint, paging, pressure and optim
(it uses measure, loss and checkpoint: the activation plan is
:mod:`tightfit.checkpoint.long_step`). bitsandbytes does the quantization, peft the adapters.
Entry point: :func:`tightfit.prepare` (:func:`tightfit.qlora.prepare.prepare`).
"""
