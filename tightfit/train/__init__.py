"""tightfit.train."""
