"""Coverage of the clipping engine (issues 12 and 13): every trainable parameter is clipped exactly, or refused with
a message that names the real cause — and coverage never depends on ``dp_self_check``.

Each exact case is checked against the float64 oracle: σ = 0, q = 1, SGD with lr = 1, so the update is
``(1/B) Σ_i min(1, C/‖g_i‖) g_i`` with ``g_i`` the gradient of **the model's own loss on a batch of one**
(``model(**example, labels=...).loss``), not a re-implementation of ours.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset as TorchDataset

from hf_dp import DPTrainer, DPTrainingArguments, UnsupportedLayerError
from hf_dp.clipping.engine import ClippingEngine


def dp_args(tmp_path, batch: int, max_norm: float, ga: int = 1, **kw) -> DPTrainingArguments:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(
            output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=max_norm,
            per_device_train_batch_size=batch, gradient_accumulation_steps=ga, max_steps=1, learning_rate=1.0,
            optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True, report_to="none",
            save_strategy="no", dp_seed=0, disable_tqdm=True, **kw,
        )


class Rows(TorchDataset):
    """A map-style dataset of ready tensors (one example per row, no batch axis)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self.rows[i])


def oracle_grads(model: nn.Module, rows: Rows) -> list[dict[str, torch.Tensor]]:
    """Each example's gradient of the model's own loss on a batch of one (dropout off: configs set it to 0)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    model.train()
    for i in range(len(rows)):
        batch = {k: v.unsqueeze(0) for k, v in rows[i].items()}
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        out.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    return out


def check_exact(model: nn.Module, rows: Rows, tmp_path, ga: int = 1, per_example_loss=None, **kw) -> DPTrainer:
    """One DP step over all of ``rows`` (q = 1, σ = 0; ``ga`` chunks) equals the oracle's clipped mean; about half the
    examples are clipped. HF's causal-LM loss computes in float32 even for a float64 model, hence the tolerance."""
    model = model.double()
    grads = oracle_grads(model, rows)
    norms = sorted(float(torch.sqrt(sum(g.pow(2).sum() for g in d.values()))) for d in grads)
    max_norm = norms[len(norms) // 2]
    expected = {n: sum(min(1.0, max_norm / (float(torch.sqrt(sum(t.pow(2).sum() for t in d.values()))) + 1e-6))
                       * d[n] for d in grads) for n in grads[0]}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = len(rows)
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, n // ga, max_norm, ga=ga, **kw), train_dataset=rows,
                        per_example_loss=per_example_loss)
    trainer.train()
    assert trainer.accountant.steps == 1
    for name, p in model.named_parameters():
        target = expected[name] / n if name in expected else torch.zeros_like(p)
        atol = 1e-6 * float(target.abs().max()) + 1e-12
        torch.testing.assert_close(before[name] - p.detach(), target, rtol=1e-5, atol=atol, msg=name)
    return trainer
