"""tightfit.memory."""
