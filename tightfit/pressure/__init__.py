"""tightfit.pressure: how full the device is, and what the paged optimizer does about it.

Here:
    probes: ``Probe`` and its kinds (CUDA, process RSS, memory cgroup).
    room: ``machine_room``, the bytes a step could still add and what bounds them (the
        ``Room`` long-step planning reads).
    highwater: a probe's high-water mark between steps.
    target: ``default_target`` and the target's forms (fraction, bytes, "auto", None).
    occupancy: ``OccupancyControl``, which keeps the device under the target by evicting and
        restoring pages of :mod:`tightfit.paging`'s store; ``recover_from_oom``;
        ``default_probe`` (the probe a device gets when none is given).
    watch: ``PressureWatch``, hooks on the model's blocks that see an activation spike coming.

May import measure, model, integrity, tiers, loss, checkpoint (the ``Room`` it returns) and
paging. The entry point for users is
``optimizer_for(model, OptimizerOptions(target=...))``; ``OccupancyControl`` and
``PressureWatch`` are public for those who build an optimizer themselves. The test fake
``FakeProbe`` is not here: it is ``tests/pressure/fakes.py``'s.
"""
