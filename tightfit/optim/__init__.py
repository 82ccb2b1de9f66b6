"""tightfit.optim: the paged optimizers, ``torch.optim`` drop-ins whose state lives in pages.

Here:
    registry: ``optimizer_for(model, options)``, the optimizer over a model's trainable
        parameters, and which class each kind is.
    optimizer_options: ``OptimizerOptions`` (every choice ``optimizer_for`` and ``tightfit
        train`` take, with ``RECIPE_LR``); its ``paging`` is the store's ``PagingOptions``.
    base: ``PagedOptimizer``: the page store, the step sweep, OOM recovery, the memory API
        (``pager``, ``set_pressure``, ``watch``, ``memory_stats``) and the subclass contract.
    param_groups: params and param groups: the constructor's checks, a group cut into pages.
    param_state: ``optimizer.state[p]`` (``ParamState``), read and written in the pages.
    torch_api: torch's state API on a paged optimizer: state dicts with hooks, page files,
        copy and pickle.
    torch_format: state in and out as torch-format state dicts (what ``torch.optim`` reads).
    page_file: state streamed to a file and back page by page, every byte checksummed.
    element_order: ``ElementOrder``, the order of a param's elements in its pages.
    update_lists: the lists an update kernel gets for a bucket of pages, cached across steps.
    hyper: the hyperparameter checks (torch's rules and words) and the kernel the flags pick.
    adamw / sgd / lion: ``PagedAdamW``, ``PagedAdam``, ``PagedSGD``, ``PagedLion`` (fp32 state)
        and ``PagedLion8bit``.
    paged8bit: ``Paged8bitOptimizer``, bitsandbytes-style blockwise 8-bit state: layout,
        update, state dicts in and out; adamw8bit: ``PagedAdamW8bit``, ``PagedAdam8bit``.
    quant8: blockwise 8-bit quantization (bitsandbytes' maps and kernels, a plain-torch path).
    dtensor: FSDP2 (DTensor) params: page and update the local shard, hand back DTensors.
    demo: ``tightfit demo``.

May import measure, model, integrity, tiers, paging and pressure (it uses integrity, tiers,
paging and pressure). The entry point is ``tightfit.optimizer_for(model, OptimizerOptions(...))``;
the classes (``PagedAdamW(params, lr=..., device_budget=...)``) are for those who build an
optimizer themselves.
"""
