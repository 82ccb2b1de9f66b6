"""tightfit.model: a causal LM seen as a chain of blocks (its decoder layers).

Here: :mod:`~tightfit.model.blocks` (``find_blocks``, ``resolve_blocks``). Imports only
:mod:`tightfit.measure`. Both activation checkpointing (:mod:`tightfit.checkpoint`) and the
spike watch (:mod:`tightfit.pressure.watch`) walk the same blocks, so they sit above it.
"""
