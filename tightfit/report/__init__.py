"""tightfit.report: the measured per-piece memory report of a run (what each piece saved).

Here:
    report: ``measure_report(model, batch, optimizer=...)``: one row per piece, without and
        with it, measured on the real batch; ``optimizer_state_bytes``.
    pieces: the byte counts behind the rows (4-bit weights, quantization constants, LoRA
        params and grads, the activation peak with the plan and chunked loss taken off).
    document: ``MemoryReport`` and its renderings (text table, JSON, Markdown, PNG bars).

May import measure, model, integrity, tiers, loss, checkpoint, paging, pressure, optim and
qlora (it uses measure, loss, checkpoint and qlora). Entry point:
:func:`tightfit.measure_report` (:func:`tightfit.report.report.measure_report`).
"""
