"""tightfit.tiers: the places bytes live (device, host, disk) and the engines that move them.

Below both of its users: the paged optimizers' state (:mod:`tightfit.paging`) and offloaded
activations (:mod:`tightfit.checkpoint`) move through the same copy engines and spill files.
"""
