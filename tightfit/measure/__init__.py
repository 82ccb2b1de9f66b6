"""tightfit.measure: live-byte tracking (CPU and CUDA), byte sizes and dtype names; lowest level."""
