"""Automatic clipping (Bu et al., NeurIPS 2023; issue 25 item 1): ``clipping_function="automatic"``.

Each example's (user's, packed segment's) gradient is scaled by ``C / (‖g‖ + γ)`` — per group ``C_k / (‖g_k‖ + γ)``.
The oracles (float64, σ = 0, SGD with lr = 1) are loops over single examples whose loss is the model's own loss on a
batch of one, with that factor written out here; the neighbouring-dataset test shows the sensitivity is still C.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import (
    AUTHORS,
    adam_args,
    assert_updates_close,
    automatic_clipped_sum,
    cls_dataset,
    dp_args,
    example_norms,
    lm_dataset,
    make_sft_trainer,
    per_example_grads,
    sampled_indices,
    sft_args,
    sft_dataset,
    sft_row_grads,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    user_args,
    user_data,
)
from helpers.neighbours import (
    C,
    N,
    assert_neighbours_within_c,
    bert,
    bert_data,
    distance,
    neighbour_args,
    params,
    regression_data,
    regression_model,
    summed_updates,
)

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.clipping.modes import GroupClipper, clip_factors_from_norms

GAMMA = 0.01


def automatic_sum(grads, max_norm: float, gamma: float = GAMMA) -> dict[str, torch.Tensor]:
    """Σ_i C / (‖g_i‖ + γ) · g_i, one norm over all parameters (``helpers.automatic_clipped_sum``)."""
    return automatic_clipped_sum(grads, max_norm, gamma)


def assert_update(model, before, expected, expected_batch):
    for k, p in model.named_parameters():
        target = expected[k] / expected_batch if p.requires_grad else torch.zeros_like(p)
        torch.testing.assert_close(before[k] - p.detach(), target, rtol=1e-7, atol=1e-12, msg=k)


@pytest.mark.parametrize("gamma", [GAMMA, 0.5])
def test_flat_automatic_matches_oracle(tmp_path, gamma):
    """GPT-2 with tied embeddings, q = 1 in three chunks of two; C below and above the norms (every example scaled,
    small ones up, large ones down); γ = 0.5 so that γ visibly matters."""
    torch.manual_seed(0)
    model = tiny_gpt2().double()
    data = lm_dataset(6)
    indices = sampled_indices(6, 1.0, 3, seed=3)
    grads = per_example_grads(model, data, indices)
    max_norm = float(np.median(example_norms(grads)))
    expected = automatic_sum(grads, max_norm, gamma)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    args = dp_args(tmp_path, 2, 3, max_norm, seed=3, clipping_function="automatic", automatic_clipping_gamma=gamma)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert_update(model, before, expected, 6)


def test_flat_automatic_poisson_batch_bert(tmp_path):
    """A Poisson batch (q < 1) on BERT classification, several micro-batches per chunk."""
    torch.manual_seed(0)
    model = tiny_bert(num_labels=3).double()
    data = cls_dataset(12, num_labels=3)
    indices = sampled_indices(12, 6 / 12, 2, seed=7)
    grads = per_example_grads(model, data, indices)
    expected = automatic_sum(grads, 0.3)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    args = dp_args(tmp_path, 3, 2, 0.3, seed=7, clipping_function="automatic")
    DPTrainer(model=model, args=args, train_dataset=data).train()
    assert_update(model, before, expected, 6)


def test_per_layer_automatic_matches_oracle(tmp_path):
    """Per-layer groups (tied wte/lm_head one group): Σ_i Σ_k C_k / (‖g_{i,k}‖ + γ) g_{i,k}, with C_k the default
    C/√K, inside the backward pass."""
    torch.manual_seed(0)
    model = tiny_llama().double()
    data = lm_dataset(6)
    indices = sampled_indices(6, 1.0, 3, seed=3)
    grads = per_example_grads(model, data, indices)
    args = dp_args(tmp_path, 2, 3, 1.0, seed=3, clipping="per_layer", clipping_function="automatic")
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    groups = [g.params for g in trainer.group_clipper.groups]
    thresholds = trainer.group_clipper.thresholds.tolist()
    assert thresholds == pytest.approx([1.0 / math.sqrt(len(groups))] * len(groups))
    expected = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for g in grads:
        for names, c_k in zip(groups, thresholds):
            norm = math.sqrt(sum(float(g[n].pow(2).sum()) for n in names))
            for n in names:
                expected[n] += c_k / (norm + GAMMA) * g[n]
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    assert_update(model, before, expected, 6)


@pytest.mark.parametrize("contribution", ["mean", "sum"])
def test_user_level_automatic_matches_oracle(tmp_path, contribution):
    """Each sampled user's whole contribution g_u (mean or sum of their examples' gradients) scaled by
    C / (‖g_u‖ + γ)."""
    from hf_dp.sampling import PoissonUserSampler

    torch.manual_seed(0)
    data = user_data()
    model = tiny_gpt2().double()
    users = np.unique(AUTHORS, return_inverse=True)[1]
    indices = next(iter(PoissonUserSampler(users, 0.6, steps_per_epoch=2, num_chunks=1, seed=5)))
    owners = [AUTHORS[i] for i in indices]
    grads = per_example_grads(model, data, indices)
    max_norm = 0.4
    expected = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for user in sorted(set(owners)):
        mine = [g for g, o in zip(grads, owners) if o == user]
        w = 1.0 / len(mine) if contribution == "mean" else 1.0
        g_u = {n: w * sum(g[n] for g in mine) for n in expected}
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g_u.values()))
        for n in expected:
            expected[n] += max_norm / (norm + GAMMA) * g_u[n]
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    args = user_args(tmp_path, user_contribution=contribution, per_sample_max_grad_norm=max_norm,
                     clipping_function="automatic")
    DPTrainer(model=model, args=args, train_dataset=data).train()
    assert_update(model, before, expected, 3)


def test_dp_sft_packed_automatic_matches_oracle(tmp_path):
    """DP-SFT with packing: each packed segment (row) is one example, scaled by C / (‖g‖ + γ); the oracle is each
    row's own loss (trl's labels) on a batch of one."""
    pytest.importorskip("trl")

    torch.manual_seed(0)
    trainer = make_sft_trainer(tiny_llama().double(), sft_dataset("prompt_completion"),
                               sft_args(tmp_path, packing=True, clipping_function="automatic",
                                        per_sample_max_grad_norm=0.7))
    grads = sft_row_grads(trainer, list(range(4)))
    expected = {n: -g / 4 for n, g in automatic_sum(grads, 0.7).items()}
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    trainer.train()
    assert_updates_close({n: p.detach() - before[n] for n, p in params.items()}, expected, rtol=1e-5, atol=1e-8)


def test_neighbouring_datasets_move_the_sum_by_less_than_c(tmp_path):
    """σ = 0, q = 1: removing one example moves Σ by exactly C·‖g‖/(‖g‖+γ) of that example's gradient (< C), however
    large or small its norm — flat and per-layer (there the distance is ‖(C_k‖g_k‖/(‖g_k‖+γ))_k‖ < ‖C‖ = C)."""

    removed = per_example_grads(bert(), bert_data(5), [4])[0]
    norm = example_norms([removed])[0]
    sigma_d, sigma_d2 = summed_updates(tmp_path / "flat", clipping_function="automatic")
    moved = distance(sigma_d, sigma_d2)
    assert moved == pytest.approx(C * norm / (norm + GAMMA), rel=1e-6) and moved < C
    assert_neighbours_within_c(tmp_path / "per_layer", clipping="per_layer", clipping_function="automatic")


def test_factors_bounded_and_nonfinite_examples_get_zero():
    norms = torch.tensor([0.0, 1e-8, 0.5, 1.0, 1e6, float("nan"), float("inf")], dtype=torch.float64)
    f = clip_factors_from_norms(norms, 2.0, "automatic", 0.01)
    torch.testing.assert_close(f[:5], 2.0 / (norms[:5] + 0.01))
    assert f[5] == 0 and f[6] == 0
    assert bool((f[:5] * norms[:5] < 2.0).all())
    with pytest.raises(ValueError, match="clipping_function"):
        clip_factors_from_norms(norms, 2.0, "auto")


def test_adaptive_with_automatic_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="no example is unclipped"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, clipping="adaptive_per_layer",
                                clipping_function="automatic")
    with pytest.raises(ValueError, match="no example is unclipped"):
        GroupClipper([], [], adaptive=True, function="automatic")


@pytest.mark.parametrize("kwargs, match", [
    (dict(clipping_function="normalize"), "clipping_function must be one of"),
    (dict(clipping_function="automatic", automatic_clipping_gamma=0.0), "automatic_clipping_gamma"),
    (dict(automatic_clipping_gamma=float("nan")), "automatic_clipping_gamma must be a finite number"),
])
def test_argument_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, **kwargs)


def test_nan_example_keeps_factor_zero(tmp_path):
    """A NaN regression label under automatic clipping: σ = 0, q = 1, the update is the automatic oracle over the
    finite examples; the NaN example is counted (factor 0, never C/(NaN + γ))."""

    data = regression_data(N)
    model = regression_model()
    grads = []
    for i in range(N):
        if i == 2:  # the NaN label
            continue
        row = data[i]
        model.zero_grad(set_to_none=True)
        model(input_ids=torch.tensor([row["input_ids"]]), attention_mask=torch.tensor([row["attention_mask"]]),
              labels=torch.tensor([row["labels"]], dtype=torch.float64)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    expected = automatic_sum(grads, C)
    args = neighbour_args(tmp_path, N, dp_self_check=False, clipping_function="automatic")
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    before = params(model)
    trainer.train()
    assert trainer.nonfinite_examples == 1
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()) * N, expected[n], rtol=1e-7, atol=1e-12, msg=n)


def test_model_card_lists_automatic_clipping_and_dp_adam_bc(tmp_path):
    trainer = DPTrainer(model=tiny_bert(num_labels=2), train_dataset=cls_dataset(16, num_labels=2),
                        args=adam_args(tmp_path, max_steps=1, clipping_function="automatic"))
    trainer.train()
    trainer.save_model()
    card = (tmp_path / "README.md").read_text()
    for line in ("clipping_function (Bu et al. 2023: C/(‖g‖+γ)): automatic", "automatic_clipping_gamma: 0.01",
                 "dp_adam_bias_correction (Tang et al. 2024): True", "dp_adam_bc_epsilon: 1e-07", "DPAdamBC"):
        assert line in card
