"""Offload placements on the CPU (the next tier is a spill file): gradients equal the unchecked
run, the bytes really leave the tracked memory and land in the file, peaks as predicted, the
schedule is one segment ahead, buffers are reused, and failures are clean."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

import tightfit.checkpoint as ck
from tightfit.checkpoint import apply
from tightfit.qlora.quantize import quantize_linears
from tightfit.tiers.regions import PAGE, TierFullError

from .conftest import loss_and_grads, tiny_llama
from .offloaded import (
    MIN_BYTES,
    disk_tier,
    install,
    mapped_rss,
    max_diff,
    offloader,
    spill_files,
    step,
)

pytestmark = pytest.mark.filterwarnings("ignore:tightfit.checkpoint")
PLACEMENTS = {
    "stored_offload": ["stored_offload"],
    "checkpoint_offload": ["checkpoint_offload"],
    "mixed": ["stored_offload", "checkpoint_offload", "stored", "checkpoint"],
}


@pytest.fixture(scope="module")
def llama() -> tuple:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_llama(layers=6, hidden=64, dropout=0.2, vocab=256)
    x = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": x, "labels": x}
    ref = step(model, batch)
    assert not torch.equal(step(model, batch, seed=2)[0], ref[0])  # dropout is on
    return model, batch, ref, ck.profile(model, batch)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_grads_equal_and_peak_as_predicted(llama: tuple, placement: str) -> None:
    model, batch, (loss0, g0, _), prof = llama
    plan = install(model, prof, PLACEMENTS[placement])
    try:
        off = offloader(model)
        loss1, g1, peak = step(model, batch)
        moved = off.bytes_offloaded
        loss2, g2, _ = step(model, batch)  # a second step on the same buffers
    finally:
        ck.disable(model)
    assert torch.equal(loss0, loss1) and torch.equal(loss0, loss2)
    assert max_diff(g0, g1) <= 1e-6 and max_diff(g0, g2) <= 1e-6
    assert 0.9 * plan.predicted_peak_bytes <= peak <= 1.1 * plan.predicted_peak_bytes
    # every byte the plan predicts on the next tier went there (regions are whole pages)
    assert moved > 0 and plan.host_bytes == off.pool.peak_used_bytes
    assert moved <= plan.host_bytes < moved + PAGE * 64


def test_offloaded_bytes_leave_the_device_and_land_in_the_spill_file(llama: tuple) -> None:
    model, batch, (_, _, stored_peak), prof = llama
    stored_pred = ck.enable(model, "none", profiled=prof).predicted_peak_bytes
    ck.disable(model)
    inputs: list[torch.Tensor] = []
    hook = model.model.layers[1].register_forward_pre_hook(
        lambda _m, args, kwargs: inputs.append((args or (kwargs["hidden_states"],))[0].detach().clone()),
        with_kwargs=True)
    plan = install(model, prof, "stored_offload")
    try:
        off = offloader(model)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = model(**batch).loss  # forward only: the saved tensors now wait on disk
        off.engine.then(lambda: None).result()  # the copy thread has released the pages
        folder = off.spill.folder
        assert spill_files(off) == ["group0.spill"] and off.pool.chunks_made == 1
        with open(os.path.join(folder, "group0.spill"), "rb") as f:
            data = f.read()
        # block 1's input, saved by its norm (block 0's, the embedding output, stays: the
        # model's forward holds it)
        at = data.find(inputs[0].numpy().tobytes())
        assert at >= 0 and at % PAGE == 0
        if os.path.exists("/proc/self/smaps"):  # and it is not in this process's RAM
            assert mapped_rss(folder) <= 16 * PAGE < off.bytes_offloaded // 8
        loss.backward()
        peak = step(model, batch)[2]
    finally:
        hook.remove()
        ck.disable(model)
    assert not os.path.exists(folder)  # disable deletes the spill files
    # the tracked peak drops by what the plan says it drops
    saved, predicted = stored_peak - peak, stored_pred - plan.predicted_peak_bytes
    assert saved > 0.3 * stored_peak
    assert abs(saved - predicted) <= 0.1 * predicted


def test_frozen_nf4_base_and_lora(llama: tuple) -> None:
    torch.manual_seed(0)
    base = tiny_llama(layers=4, hidden=64, dropout=0.1, vocab=256)
    quantize_linears(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                            lora_dropout=0.1))
    x = torch.randint(0, 256, (2, 64))
    batch = {"input_ids": x, "labels": x}
    loss0, g0 = loss_and_grads(model, batch)
    assert g0 and all("lora_" in n for n in g0)
    prof = ck.profile(model, batch)
    plan = install(model, prof, PLACEMENTS["mixed"])
    try:
        loss1, g1 = loss_and_grads(model, batch)
        peak = step(model, batch)[2]
        moved = offloader(model).bytes_offloaded
    finally:
        ck.disable(model)
    assert torch.equal(loss0, loss1) and max_diff(g0, g1) <= 1e-6
    assert moved > 0
    assert 0.9 * plan.predicted_peak_bytes <= peak <= 1.1 * plan.predicted_peak_bytes


def test_offload_inputs_puts_checkpointed_inputs_on_the_next_tier(llama: tuple) -> None:
    model, batch, (loss0, g0, _), prof = llama
    plan = ck.enable(model, "every", profiled=prof, offload="inputs", offload_min_bytes=MIN_BYTES,
                     offload_bandwidth=1e9)
    try:
        assert {s.kind for s in plan.segments} == {"checkpoint_offload"}
        assert plan.offload and plan.checkpointed_blocks == len(prof.blocks)
        loss1, g1, _ = step(model, batch)
        off = offloader(model)
        # each segment's input (the hidden state) went out and came back once; the chain's
        # first input stays (the model holds it: nothing to free)
        x = prof.blocks[0].input_bytes
        assert off.bytes_offloaded == off.bytes_fetched == (len(prof.blocks) - 1) * x
    finally:
        ck.disable(model)
    assert torch.equal(loss0, loss1) and max_diff(g0, g1) <= 1e-6


def test_prefetch_is_one_segment_ahead(llama: tuple) -> None:
    model, batch, _, prof = llama
    install(model, prof, "stored_offload")
    try:
        off = offloader(model)
        fetches = []
        fetch = off.engine.fetch
        off.engine.fetch = lambda home, dst: fetches.append(home.data_ptr()) or fetch(home, dst)
        off.trace = trace = []
        step(model, batch)
    finally:
        ck.disable(model)
    assert len(fetches) == sum(e == "fetch" for e, _ in trace)  # every fetch went to the engine

    def first(event: str, seg: int) -> int:
        return next(i for i, e in enumerate(trace) if e == (event, seg))

    def last(event: str, seg: int) -> int:
        return max(i for i, e in enumerate(trace) if e == (event, seg))

    n = len(prof.blocks)
    for k in range(1, n):
        # segment k - 1 is requested before segment k's backward uses its own tensors...
        assert first("fetch", k - 1) < first("wait", k)
        if k >= 2:  # ...and segment k - 2 only after segment k's backward is done
            assert first("fetch", k - 2) > last("wait", k)
    # forward: a segment's writes are retired when the segment after next starts
    for k in range(n - 2):
        assert last("put", k + 1) < first("retire", k) < first("put", k + 2)


def test_no_host_buffer_is_allocated_after_the_first_step(llama: tuple) -> None:
    model, batch, _, prof = llama
    install(model, prof, PLACEMENTS["mixed"])
    try:
        off = offloader(model)
        made = []
        for _ in range(3):
            step(model, batch)
            made.append((off.pool.chunks_made, off.pool.capacity_bytes, spill_files(off)))
            assert off.pool.used_bytes == 0  # every region came back
    finally:
        ck.disable(model)
    assert made[0] == made[1] == made[2] and made[0][0] == 1


@pytest.mark.parametrize("how", ["fallocate_enospc", "tmpfs"])
def test_full_disk_is_an_error_naming_the_tier_and_the_step_can_be_rerun(
        llama: tuple, tmp_path, monkeypatch, how: str) -> None:  # noqa: ANN001
    model, batch, (loss0, g0, _), prof = llama
    offload_dir = tmp_path / "spill"
    offload_dir.mkdir()
    if how == "tmpfs":
        if os.system(f"mount -t tmpfs -o size=64k tmpfs {offload_dir} 2>/dev/null") != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
    else:
        def full(fd: int, offset: int, nbytes: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        install(model, prof, "stored_offload", tier=disk_tier(offload_dir=str(offload_dir)))
        model.zero_grad(set_to_none=True)
        with pytest.raises(TierFullError, match=rf"offload tier 'disk' \(spill folder {offload_dir}"
                                                r".*no room for \d+ bytes"):
            model(**batch).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # nothing was half done
        if how == "tmpfs":
            assert os.system(f"mount -o remount,size=64m {offload_dir}") == 0  # room now
        else:
            monkeypatch.undo()
        loss1, g1, _ = step(model, batch)
        assert offloader(model).pool.chunks_made == 1
    finally:
        ck.disable(model)
        if how == "tmpfs":
            os.system(f"umount {offload_dir}")
    assert torch.equal(loss0, loss1) and max_diff(g0, g1) <= 1e-6


def test_disable_takes_everything_off(llama: tuple) -> None:
    model, batch, _, prof = llama
    layer = model.model.layers[0]
    before = (dict(layer.__dict__).keys(), len(layer._forward_pre_hooks),
              len(layer._forward_hooks), len(model._forward_hooks))
    install(model, prof, PLACEMENTS["mixed"])
    off = offloader(model)
    step(model, batch)
    folder = off.spill.folder
    assert os.path.isdir(folder)
    ck.disable(model)
    assert not os.path.exists(folder) and not apply.is_enabled(model)
    assert (dict(layer.__dict__).keys(), len(layer._forward_pre_hooks),
            len(layer._forward_hooks), len(model._forward_hooks)) == before


def test_plan_shows_its_placements_and_the_next_tier(llama: tuple) -> None:
    model, _, _, prof = llama
    plan = install(model, prof, PLACEMENTS["mixed"])
    ck.disable(model)
    text = str(plan)
    assert "3 checkpointed segments, 4 offloaded" in text
    for kind in ("stored_offload", "checkpoint_offload", "stored ", "checkpoint "):
        assert kind in text
    tier_line = next(line for line in text.splitlines() if "next tier (disk)" in line)
    assert f"{plan.host_bytes / 2**20:.1f} MiB" in tier_line and "GB/s" in tier_line
