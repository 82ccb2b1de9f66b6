"""The CPU copy engine's share of the cores: an update beside its copies leaves them theirs."""

from __future__ import annotations

import pytest
import torch

from tightfit.tiers.copy import CopyEngine


@pytest.mark.parametrize(("threads", "copies", "inside"), [(4, 2, 2), (2, 2, 1), (1, 1, 1),
                                                           (3, 0, 3)])
def test_cpu_engine_leaves_the_copy_threads_their_cores_in_the_block(threads, copies, inside
                                                                     ) -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = CopyEngine()
        with engine.beside_copies(copies):
            assert torch.get_num_threads() == inside  # at least one for the update
        assert torch.get_num_threads() == threads
        with pytest.raises(KeyError), engine.beside_copies(copies):
            raise KeyError("a failed update")
        assert torch.get_num_threads() == threads  # restored, raised or not
        engine.close()
    finally:
        torch.set_num_threads(n)
