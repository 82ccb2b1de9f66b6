"""tightfit.integrity: what keeps state whole when the machine fails.

Here:
    checksums: XXH3-64 of pages and files (``checksum``, ``file_checksum``,
        ``CorruptStateError``).
    interrupts: ``hold_interrupts()``, Ctrl-C held until an update or a save is whole.
    owners: which live process owns a spill folder or temp; a dead run's are removed.
    temps: atomic writes (a temp beside the target, renamed into place).

Imports nothing of tightfit but :mod:`tightfit.measure`. Its users: the spill files
(:mod:`tightfit.tiers`), the page store's disk tier (:mod:`tightfit.paging`), the optimizers'
page files (:mod:`tightfit.optim`) and the resume state (:mod:`tightfit.train.resume`).
"""
