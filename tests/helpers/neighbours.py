"""The neighbouring-datasets harness (DESIGN invariant 8): the DP guarantee as a black-box property.

With σ = 0 and q = 1 (SGD, lr = 1, constant schedule, float64), train once on D and once on D′ = D without its last
example, same seed: the summed clipped gradients Σ_D and Σ_D′ of the step must differ by at most C (the L2
sensitivity of the release; Abadi et al. 2016, §3.1). C is small, so every example is clipped and an unclipped
gradient shows as a jump far above C. The harness only reads parameters before and after ``train()``.
"""

from __future__ import annotations

import math

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification

from hf_dp import DPTrainer, DPTrainingArguments

from .data import cls_dataset
from .models import tiny_bert
from .runs import dp_args

C = 1e-2  # small: every example is clipped, so an unclipped gradient shows as a jump far above C
N = 5


def neighbour_args(tmp_path, m: int, ga: int = 1, sigma: float = 0.0, **overrides) -> DPTrainingArguments:
    """q = 1: per-device batch × GA = m examples; SGD with lr = 1 and a constant schedule: θ₁ = θ₀ − Σ/m; C = ``C``,
    noise multiplier ``sigma``, nothing logged."""
    base = dict(noise_multiplier=sigma, logging_strategy="no")
    base.update(overrides)
    return dp_args(tmp_path, m // ga, ga, C, **base)


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return tiny_bert().double()


def bert_data(n: int) -> Dataset:
    return cls_dataset(N, 3).select(range(n))


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def default_build(args, data, model_factory=bert):
    return DPTrainer(model=model_factory(), args=args, train_dataset=data)


def train_once(trainer):
    trainer.train()


def summed_updates(tmp_path, build=default_build, data_fn=bert_data, n=N, ga=1, sigma=0.0, train=train_once,
                   neighbour=True, **kw) -> list[dict[str, torch.Tensor]]:
    """Train on D (n examples) and D′ (the last one removed), same seed; return ``{param: Σ}`` for both runs, where
    ``Σ = (θ₀ − θ₁) · m`` is the summed clipped (and noised) gradient of the step (q = 1, SGD, lr = 1)."""
    out = []
    for m in (n, n - 1) if neighbour else (n,):
        ga_m = m if ga == "all" else ga
        trainer = build(neighbour_args(tmp_path / f"n{m}", m, ga=ga_m, sigma=sigma, **kw), data_fn(m))
        before = params(trainer.model)
        train(trainer)
        after = params(trainer.model)
        out.append({k: (before[k] - after[k]) * m for k in after if k in before})
    return out


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in a))


def assert_neighbours_within_c(tmp_path, **kw):
    sigma_d, sigma_d2 = summed_updates(tmp_path, **kw)
    moved = distance(sigma_d, sigma_d2)
    assert 0 < moved <= C * (1 + 1e-6), f"‖Σ_D − Σ_D′‖ = {moved:.3g} > C = {C}"
    return sigma_d


def regression_data(m: int, nan_at: int | None = 2) -> Dataset:
    """N regression rows (labels −1.5 … 1.5), one label NaN unless ``nan_at`` is None; the first ``m``."""
    data = cls_dataset(N, 2).to_dict()
    data["labels"] = [float(i) - 1.5 for i in range(N)]
    if nan_at is not None:
        data["labels"][nan_at] = float("nan")
    return Dataset.from_dict(data).select(range(m))


def regression_model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=61, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     num_labels=1, pad_token_id=0)
    return BertForSequenceClassification(cfg).double()
