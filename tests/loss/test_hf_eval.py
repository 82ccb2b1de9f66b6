"""Chunked loss in eval (issue 16, item 8): the logits are there when the caller needs them —
eval mode, ``return_logits=True`` — and the switch to keep the chunked loss (``eval_logits``,
``return_logits=False``) is honoured; the loss is HF's either way."""

from __future__ import annotations

import pytest
import torch
import transformers

from tightfit.loss import disable_chunked_loss, enable_chunked_loss

V = 97


def _model() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, 13))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def test_eval_mode_returns_hfs_logits_and_loss() -> None:
    model = _model().eval()
    ids, labels = _batch()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        enable_chunked_loss(model, 5)
        got = model(input_ids=ids, labels=labels)
        model.train()
        trained = model(input_ids=ids, labels=labels)
    assert got.logits is not None and torch.equal(got.logits, ref.logits)
    assert torch.equal(got.loss, ref.loss)
    assert trained.logits is None  # training mode: the chunked loss, no full logits
    torch.testing.assert_close(trained.loss, ref.loss, rtol=1e-6, atol=0)
    disable_chunked_loss(model)


def test_eval_logits_false_and_return_logits_override() -> None:
    model = _model()
    ids, labels = _batch()
    with torch.no_grad():
        ref = model.eval()(input_ids=ids, labels=labels)
        enable_chunked_loss(model, 5, eval_logits=False)
        kept = model(input_ids=ids, labels=labels)  # eval mode, chunked all the same
        asked = model(input_ids=ids, labels=labels, return_logits=True)
        enable_chunked_loss(model, 5)
        refused = model(input_ids=ids, labels=labels, return_logits=False)
        model.train()
        in_training = model(input_ids=ids, labels=labels, return_logits=True)
    assert kept.logits is None and refused.logits is None
    torch.testing.assert_close(kept.loss, ref.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(refused.loss, ref.loss, rtol=1e-6, atol=0)
    assert torch.equal(asked.logits, ref.logits) and torch.equal(in_training.logits, ref.logits)
    with pytest.raises(TypeError, match="eval_logits must be True or False"):
        enable_chunked_loss(model, 5, eval_logits="yes")  # type: ignore[arg-type]
    disable_chunked_loss(model)
