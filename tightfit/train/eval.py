"""The eval loss of a run: the token-weighted mean loss over the whole eval set, and its
perplexity.

Each micro-batch's loss comes back as a sum (``num_items_in_batch=1``), so the mean over the
set weighs every target token once, however the batches are padded; under torchrun each rank
evaluates its rows and the sums are added. Evaluation runs in eval mode without gradients and
draws no random numbers, so a resumed run's training steps stay bit-exact.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tightfit.loss import is_chunked_loss_enabled

if TYPE_CHECKING:
    from tightfit.train.run_setup import Run


def evaluate(run: Run) -> dict[str, float]:
    """``{"eval_loss", "eval_perplexity", "eval_tokens"}`` of the run's model on its eval set.

    Raises:
        ValueError: the run has no eval data.
    """
    if run.data.eval is None:
        raise ValueError("no eval data: pass --eval-data or --eval-fraction.")
    model, job = run.model, run.job
    world = job.info.world_size if job.distributed else 1
    total = torch.zeros(2, dtype=torch.float64)
    was_training = model.training
    # only the loss is needed: keep the chunked loss (no full logits) in eval mode too
    extra = {"return_logits": False} if _chunked(model) else {}
    model.eval()
    try:
        with torch.no_grad():
            for micro in run.data.eval.eval_batches(row_multiple=world):
                inputs = {k: v.to(run.device) for k, v in job.rows(micro.inputs).items()}
                loss = run.runner(**inputs, num_items_in_batch=1, **extra).loss
                mine = (inputs["labels"][:, 1:] != -100).sum()
                total += torch.stack([loss.detach().double().cpu(), mine.double().cpu()])
    finally:
        model.train(was_training)
    summed, count = job.total([float(total[0]), float(total[1])])
    mean = summed / count if count else float("nan")
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 700.0)),
            "eval_tokens": int(count)}


def _chunked(model: torch.nn.Module) -> bool:
    try:
        return is_chunked_loss_enabled(model)
    except TypeError:  # not an HF causal LM: no chunked loss to keep
        return False
