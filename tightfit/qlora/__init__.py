"""tightfit.qlora."""
