"""tightfit.checkpoint."""
