"""tightfit.optim."""
