"""tightfit.loss: the LM head and loss, computed in chunks."""
