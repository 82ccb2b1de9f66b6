"""The checksum: one flipped bit anywhere changes it, a copy hashed in chunks gives the same
value as the bytes hashed whole, and what is not a page's bytes is refused by name."""

from __future__ import annotations

import pytest
import torch

from tightfit.tiers.integrity import checksum, copy_and_checksum, zeros_checksum


def test_any_flipped_bit_changes_the_checksum() -> None:
    data = torch.randn(300_000).view(torch.uint8)  # 1.2 MB: several copy chunks
    clean = checksum(data)
    gen = torch.Generator().manual_seed(0)
    for pos in [0, 1, 4095, 262_143, 262_144, data.numel() - 1,
                *torch.randint(0, data.numel(), (20,), generator=gen).tolist()]:  # fmt: skip
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum(data) != clean, (pos, bit)
            data[pos] ^= 1 << bit
    assert checksum(data) == clean
    assert zeros_checksum(4096) == checksum(torch.zeros(4096, dtype=torch.uint8))


def test_copy_and_checksum_copies_and_hashes_what_landed() -> None:
    src = torch.randn(1_000_003).view(torch.uint8)[:-3]  # not a multiple of the chunk
    dst = torch.empty_like(src)
    assert copy_and_checksum(dst, src) == checksum(src)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="bytes to"):
        copy_and_checksum(dst[:10], src)


def test_what_is_not_a_pages_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        checksum(torch.zeros(10))
    with pytest.raises(ValueError, match="non-contiguous"):
        checksum(torch.zeros(10, dtype=torch.uint8)[::2])
