"""Batches: packing without attention across examples (the loss of padded batches, 1e-5 in
fp32), gradient accumulation equal to the larger batch, buckets by length, epochs cover every
example once."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tightfit.optim.optimizer_options import OptimizerOptions
from tightfit.qlora.prepare_options import LoraOptions, PrepareOptions
from tightfit.train.data import ByteTokenizer, load_train_data
from tightfit.train.loop import train
from tightfit.train.run_options import DataOptions, RunConfig, TrainOptions

from .helpers import write_jsonl

RECORDS = [{"prompt": "x" * (3 + 2 * i), "completion": "yz" * (2 + (7 * i) % 9)}
           for i in range(24)]  # 7 to 69 tokens


@pytest.fixture
def qa(tmp_path):
    return write_jsonl(tmp_path / "qa.jsonl", RECORDS)


def _data(path, **kw):
    opts = {"seq_len": 80, "batch_size": 4, "grad_accum": 1, "seed": 0}
    data_kw = {k: kw.pop(k) for k in list(kw) if k in ("batching", "completion_only")}
    opts.update(kw)
    return load_train_data(DataOptions(path=str(path), **data_kw), ByteTokenizer(), **opts)


def _tiny_model(use_cache: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa", use_cache=use_cache))  # fmt: skip
    return model.eval()


def test_packed_rows_give_the_loss_of_padded_batches(qa) -> None:
    import tightfit

    data = _data(qa, batching="pack", seq_len=128)
    rows = [[0, 1, 2], [3, 4]]  # two packed rows of several examples each
    packed = data.train.collate(rows, mode="pack").inputs
    padded = data.train.collate([[i] for row in rows for i in row], mode="bucket").inputs
    assert packed["input_ids"].shape[0] == 2 and "attention_mask" not in packed
    assert packed["position_ids"][0].tolist()[:5] == [0, 1, 2, 3, 4]
    model = _tiny_model()
    prepared = tightfit.prepare(_tiny_model(), quant=None, checkpoint="every", loss_chunks=16,
                                lora={"r": 4, "alpha": 8}, device="cpu")
    with torch.no_grad():
        for m in (model, prepared):  # HF's loss, and tightfit's chunked loss + recompute
            a, b = m(**packed).loss.item(), m(**padded).loss.item()
            assert abs(a - b) <= 1e-5 * abs(b), (a, b)
        # the same rows attending across examples give another loss: the test can tell
        crossing = {k: v for k, v in packed.items() if k != "position_ids"}
        assert abs(model(**crossing).loss.item() - b) > 1e-3
        # ... and so would a KV cache (transformers then skips its packed-sequence masks),
        # which is why the train job turns use_cache off
        assert abs(_tiny_model(use_cache=True)(**packed).loss.item() - b) > 1e-3
    data.close()


def test_buckets_sort_by_length_and_every_epoch_covers_every_example(qa) -> None:
    for batching in ("bucket", "pack"):
        data = _data(qa, batching=batching, seq_len=48)
        seen = []
        for step in range(len(data.train._plan(0))):  # the steps of epoch 0
            for micro in data.train.step(step):
                ids, labels = micro.inputs["input_ids"], micro.inputs["labels"]
                assert ids.shape[1] <= 48
                if batching == "bucket":
                    lengths = micro.inputs["attention_mask"].sum(1).tolist()
                    assert lengths == sorted(lengths, reverse=True)
                    seen += [tuple(r[:n]) for r, n in zip(ids.tolist(), lengths)]
                    continue
                pos = micro.inputs["position_ids"]
                for r in range(ids.shape[0]):
                    starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
                    seen += [tuple(ids[r, a:z].tolist()) for a, z in zip(starts, starts[1:])
                             if labels[r, a + 1 : z].ne(-100).any()]  # not the row's padding
                    assert labels[r, starts[:-1]].eq(-100).all()  # no example's first token
        n = len(data.train.examples)
        every = {tuple(x) for x, _ in data.train.examples.get(range(n))}
        assert len(set(seen)) == len(seen) and set(seen) <= every, batching
        # packing places every example; an epoch of buckets drops its last, partial step
        assert len(seen) == (n if batching == "pack" else n // 4 * 4), batching
        data.close()
    bucket = _data(qa, batching="bucket", batch_size=4)
    steps = [bucket.train.step(s) for s in range(6)]
    fill = [sum(m.tokens for m in ms) / sum(m.slots for m in ms) for ms in steps]
    assert min(fill) > 0.75  # similar lengths together (RECORDS' lengths vary 3x)
    bucket.close()


def test_eval_batches_cover_the_eval_set_once_with_filler_rows_masked(qa) -> None:
    data = load_train_data(DataOptions(path=str(qa), eval_fraction=0.25), ByteTokenizer(),
                           seq_len=80, batch_size=4, grad_accum=1, seed=0)
    batches = list(data.eval.eval_batches(row_multiple=4))
    assert [b.inputs["input_ids"].shape[0] for b in batches] == [4, 4]  # 6 examples + 2 fillers
    assert sum(b.targets for b in batches) == data.eval.examples.targets()
    data.close()


def _run(tmp_path, name, qa, batch_size, grad_accum):
    cfg = RunConfig(
        train=TrainOptions(model=None, out=str(tmp_path / name), steps=2, batch_size=batch_size,
                           grad_accum=grad_accum, seq_len=80, warmup_steps=0, grad_clip=None,
                           save_every=2, track_every=0),
        data=DataOptions(path=str(qa)),
        prepare=PrepareOptions(checkpoint=None),
        lora=LoraOptions(r=4, alpha=8, dropout=0.0),
        # SGD: the update scales with the gradient, so a mis-normalized sum would show
        optimizer=OptimizerOptions(kind="paged_sgd", lr=0.5, device_budget=None),
    )
    return cfg, train(cfg, progress=False, log=lambda s: None)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path, qa) -> None:
    _, big = _run(tmp_path, "big", qa, batch_size=4, grad_accum=1)
    _, accum = _run(tmp_path, "accum", qa, batch_size=2, grad_accum=2)
    for a, b in zip(big.history, accum.history):
        assert a["tokens"] == b["tokens"] and a["targets"] == b["targets"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    wa = load_file(str(big.out / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(accum.out / "adapter" / "adapter_model.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6
    assert max(w.abs().max().item() for k, w in wa.items() if "lora_B" in k) > 1e-3
    # micro-batches of 2 without accumulation are another trajectory
    _, small = _run(tmp_path, "small", qa, batch_size=2, grad_accum=1)
    ws = load_file(str(small.out / "adapter" / "adapter_model.safetensors"))
    assert max((wa[k] - ws[k]).abs().max().item() for k in wa) > 1e-4
