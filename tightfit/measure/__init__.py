"""tightfit.measure: live-byte tracking (CPU and CUDA) and byte sizes; the lowest level."""
