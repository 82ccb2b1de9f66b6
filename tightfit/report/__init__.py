"""tightfit.report: the measured per-piece memory report of a run (what each piece saved)."""
