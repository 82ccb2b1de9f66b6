"""tightfit.paging."""
