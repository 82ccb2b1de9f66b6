"""chunked_cross_entropy against HF's ForCausalLMLoss: loss and gradients, chunk by chunk."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from tightfit.loss import chunked_cross_entropy

B, T, H, V = 2, 37, 16, 101  # 74 tokens: chunk sizes below don't divide it


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    assert rel_err(a, b) <= rtol, rel_err(a, b)
    # and elementwise, with an absolute floor at rtol of the largest entry
    torch.testing.assert_close(
        a.double(), b.double(), rtol=rtol, atol=rtol * b.abs().max().item() + 1e-30
    )


def make_labels(ignore: str) -> torch.Tensor:
    labels = torch.randint(0, V, (B, T))
    if ignore == "some":
        labels[0, :20] = -100  # a whole chunk of ignored tokens at chunk_tokens <= 20
        labels[1, torch.rand(T) < 0.3] = -100
    elif ignore == "all":
        labels[:] = -100
    return labels


def run_hf(hidden, head, labels, **kw):
    hidden = hidden.detach().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = ForCausalLMLoss(head(hidden), labels, V, **kw)
    loss.backward()
    return loss.detach(), hidden.grad, {n: p.grad for n, p in head.named_parameters()}


def run_chunked(hidden, head, labels, scale=1.0, **kw):
    hidden = hidden.detach().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = chunked_cross_entropy(hidden, head, labels, **kw)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, {n: p.grad for n, p in head.named_parameters()}


@pytest.mark.parametrize("strategy", ["precompute", "recompute"])
@pytest.mark.parametrize("chunk", [8, 20, 500])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_hf_with_ignored_tokens(strategy, chunk, bias):
    head = nn.Linear(H, V, bias=bias)
    hidden = torch.randn(B, T, H)
    labels = make_labels("some")
    ref = run_hf(hidden, head, labels)
    # a grad_output other than 1: backward must scale the precomputed gradients
    got = run_chunked(hidden, head, labels, scale=3.0, chunk_tokens=chunk, strategy=strategy)
    assert_close_rel(got[0], ref[0], 1e-6)
    assert_close_rel(got[1] / 3, ref[1], 1e-6)
    for name in ref[2]:
        assert_close_rel(got[2][name] / 3, ref[2][name], 1e-6)


def test_tied_head_grads_reach_the_embedding_once_per_use():
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight  # tied, as HF ties lm_head to embed_tokens
    ids = torch.randint(0, V, (B, T))
    labels = make_labels("some")

    def step(use_chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        emb.zero_grad(set_to_none=True)
        hidden = torch.tanh(emb(ids))
        if use_chunked:
            loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16)
        else:
            loss = ForCausalLMLoss(head(hidden), labels, V)
        loss.backward()
        return loss.detach(), emb.weight.grad

    ref, got = step(False), step(True)
    assert_close_rel(got[0], ref[0], 1e-6)
    assert_close_rel(got[1], ref[1], 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_hf_within_stated_tolerance(dtype):
    # Stated tolerance below fp32: loss 1e-5 relative (fp32 accumulation, like HF); hidden
    # grad 1e-2; weight grad 1e-2 (each chunk's weight-grad matmul rounds to the param dtype
    # before the fp32 sum, where HF's one matmul rounds once).
    head = nn.Linear(H, V).to(dtype)
    hidden = torch.randn(B, T, H).to(dtype)
    labels = make_labels("some")
    ref = run_hf(hidden, head, labels)
    got = run_chunked(hidden, head, labels, chunk_tokens=8)
    assert got[0].dtype == torch.float32
    assert rel_err(got[0], ref[0]) <= 1e-5
    assert got[1].dtype == dtype
    assert rel_err(got[1], ref[1]) <= 1e-2
    for name in ref[2]:
        assert got[2][name].dtype == dtype
        assert rel_err(got[2][name], ref[2][name]) <= 1e-2


def test_under_autocast_matches_hf_under_autocast():
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    labels = make_labels("some")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run_hf(hidden, head, labels)
        got = run_chunked(hidden, head, labels, chunk_tokens=8)
    assert rel_err(got[0], ref[0]) <= 1e-5
    assert got[1].dtype == torch.float32 and rel_err(got[1], ref[1]) <= 1e-2
    assert rel_err(got[2]["weight"], ref[2]["weight"]) <= 1e-2


@pytest.mark.parametrize("strategy", ["precompute", "recompute"])
def test_all_ignored_gives_hf_result_and_zero_grads(strategy):
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    labels = make_labels("all")
    ref = run_hf(hidden, head, labels)
    got = run_chunked(hidden, head, labels, chunk_tokens=8, strategy=strategy)
    # HF's mean over zero tokens is 0/0: NaN loss, but every gradient exactly zero
    assert torch.isnan(ref[0]) and torch.isnan(got[0])
    assert torch.equal(got[1], ref[1]) and not got[1].any()
    for name in ref[2]:
        assert torch.equal(got[2][name], ref[2][name])
    # with num_items_in_batch (gradient accumulation) HF gives 0, and so do we
    ref = run_hf(hidden, head, labels, num_items_in_batch=torch.tensor(5))
    got = run_chunked(hidden, head, labels, chunk_tokens=8, num_items_in_batch=torch.tensor(5))
    assert ref[0].item() == 0.0 and got[0].item() == 0.0
    assert not got[1].any()


@pytest.mark.parametrize("n_items", [torch.tensor(123), 77])
def test_num_items_in_batch_divides_the_sum_like_hf(n_items):
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    labels = make_labels("some")
    ref = run_hf(hidden, head, labels, num_items_in_batch=n_items)
    got = run_chunked(hidden, head, labels, chunk_tokens=16, num_items_in_batch=n_items)
    assert_close_rel(got[0], ref[0], 1e-6)
    assert_close_rel(got[1], ref[1], 1e-6)
    assert_close_rel(got[2]["weight"], ref[2]["weight"], 1e-6)


def test_shift_false_takes_pre_shifted_labels():
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    labels = make_labels("some")
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    ref = run_hf(hidden, head, None, shift_labels=shifted)
    got = run_chunked(hidden, head, shifted, chunk_tokens=10, shift=False)
    assert_close_rel(got[0], ref[0], 1e-6)
    assert_close_rel(got[1], ref[1], 1e-6)


def test_frozen_head_and_no_grad_paths():
    head = nn.Linear(H, V).requires_grad_(False)
    hidden = torch.randn(B, T, H)
    labels = make_labels("some")
    ref = ForCausalLMLoss(head(hidden), labels, V)
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, head, labels, chunk_tokens=9)
    assert got.grad_fn is None
    assert_close_rel(got, ref, 1e-6)
    ref = run_hf(hidden, head, labels)
    got = run_chunked(hidden, head, labels, chunk_tokens=9)  # only the hidden needs a grad
    assert_close_rel(got[1], ref[1], 1e-6)
    assert got[2]["weight"] is None


def test_custom_ignore_index():
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H)
    labels = make_labels("none")
    labels[:, ::3] = 7  # token 7 is "ignore" here
    ref = run_hf(hidden, head, labels, ignore_index=7)
    got = run_chunked(hidden, head, labels, chunk_tokens=11, ignore_index=7)
    assert_close_rel(got[0], ref[0], 1e-6)
    assert_close_rel(got[1], ref[1], 1e-6)


def test_second_backward_through_same_graph_is_refused():
    head = nn.Linear(H, V)
    hidden = torch.randn(B, T, H, requires_grad=True)
    loss = chunked_cross_entropy(hidden, head, make_labels("none"), chunk_tokens=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk_tokens": 0}, ValueError, "chunk_tokens must be >= 1"),
        ({"chunk_tokens": 2.5}, TypeError, "chunk_tokens must be an int"),
        ({"chunk_tokens": True}, TypeError, "chunk_tokens must be an int"),
        ({"chunk_tokens": 8, "strategy": "fused"}, ValueError, "strategy"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        chunked_cross_entropy(torch.randn(B, T, H), nn.Linear(H, V), make_labels("none"), **kwargs)


def test_bad_shapes_and_head_are_named():
    with pytest.raises(ValueError, match="labels shape"):
        chunked_cross_entropy(
            torch.randn(B, T, H), nn.Linear(H, V), torch.zeros(B, T + 1).long(), chunk_tokens=4
        )
    with pytest.raises(TypeError, match="nn.Module"):
        chunked_cross_entropy(
            torch.randn(B, T, H), torch.randn(V, H), make_labels("none"), chunk_tokens=4
        )


@pytest.mark.cuda
def test_cuda_bf16_matches_hf_and_holds_less():
    from tightfit.measure.tracker import MemoryTracker

    n_vocab, hidden_size, seq = 32_000, 256, 1024
    head = nn.Linear(hidden_size, n_vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(2, seq, hidden_size, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, n_vocab, (2, seq), device="cuda")
    peaks = {}
    for name in ("hf", "chunked"):
        h = hidden.detach().requires_grad_()
        head.zero_grad(set_to_none=True)
        with MemoryTracker("cuda") as mt:
            if name == "hf":
                logits = head(h)
                loss = ForCausalLMLoss(logits, labels, n_vocab)
            else:
                loss = chunked_cross_entropy(h, head, labels, chunk_tokens=256)
            loss.backward()
        peaks[name] = (mt.peak_bytes, loss.detach(), h.grad, head.weight.grad)
        logits = None
    ref, got = peaks["hf"], peaks["chunked"]
    assert rel_err(got[1], ref[1]) <= 1e-5
    assert rel_err(got[2], ref[2]) <= 1e-2
    assert rel_err(got[3], ref[3]) <= 1e-2
    assert got[0] * 4 <= ref[0]
