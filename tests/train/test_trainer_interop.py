"""HF Trainer interop: a prepared model trains under ``Trainer(optimizers=(PagedAdamW, None))``."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tightfit
from tightfit.optim.adamw import PagedAdamW


class _Windows(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(0)
        base = torch.arange(seq) % 16  # a learnable pattern
        self.items = [(base + torch.randint(0, 4, (1,), generator=g)) % 64 for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i], "labels": self.items[i]}


def test_trainer_trains_a_prepared_model_with_paged_adamw(tmp_path) -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    data = _Windows(16, 32)
    model = tightfit.prepare(LlamaForCausalLM(cfg), checkpoint="every", loss_chunks=16,
                             lora={"r": 4, "alpha": 8})
    opt = tightfit.optimizer_for(model, kind="paged_adamw", lr=1e-2, page_bytes=4096,
                                 device_budget=8192, spill_dir=tmp_path / "spill")
    assert isinstance(opt, PagedAdamW)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=8, per_device_train_batch_size=4,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 8 and losses[-1] < losses[0]
    after = dict(model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    stats = opt.memory_stats()
    assert stats["bytes_paged_in"] > 0  # the state really paged (a budget of two pages)
    opt.close()


def test_trainer_evaluate_with_compute_metrics_gets_the_logits(tmp_path) -> None:
    """Chunked loss in eval (issue 16): eval mode runs HF's forward, so compute_metrics gets
    the logits, and the eval loss is HF's own."""
    from tightfit.loss import disable_chunked_loss

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = tightfit.prepare(LlamaForCausalLM(cfg), checkpoint="every", loss_chunks=16,
                             lora={"r": 4, "alpha": 8})
    seen = []

    def metrics(ev) -> dict[str, float]:
        seen.append(ev.predictions.shape)
        hits = ev.predictions.argmax(-1)[:, :-1] == ev.label_ids[:, 1:]
        return {"accuracy": float(hits.mean())}

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=4,
                             report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, eval_dataset=_Windows(8, 32),
                      compute_metrics=metrics)
    out = trainer.evaluate()
    assert seen == [(8, 32, 64)] and 0.0 <= out["eval_accuracy"] <= 1.0
    disable_chunked_loss(model)
    ref = trainer.evaluate()
    assert abs(out["eval_loss"] - ref["eval_loss"]) <= 1e-6 * abs(ref["eval_loss"])
