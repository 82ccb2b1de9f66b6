"""tightfit.measure: live-byte tracking (CPU and CUDA), byte sizes, dtype names; the lowest level."""
