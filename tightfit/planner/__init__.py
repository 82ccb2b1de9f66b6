"""tightfit.planner: will it fit? Shapes and presets, the memory model, the ladder, verify.

Predicts, in bytes, every piece of device memory one LoRA/QLoRA step needs, for a ladder of
configurations, before anything is loaded; ``tightfit plan`` is its command line.
"""
