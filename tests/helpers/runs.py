"""Argument builders and the exactness checks: hf_dp runs compared with the oracle of ``helpers.oracle``.

Everything here calls hf_dp; the oracle it compares with never does. The exact checks share one setting (Abadi et
al. 2016, Alg. 1 with σ = 0): SGD with lr = 1 and a constant schedule, so the parameter update is minus the
released gradient, ``(1 / (q N)) Σ_i clip(g_i)``; float64 models, dropout off.
"""

from __future__ import annotations

import socket
import warnings

import numpy as np
import torch
from torch import nn

from hf_dp import ClippingEngine, DPTrainer, DPTrainingArguments, NotPrivateWarning, PoissonBatchSampler

from .data import AUTHORS, toy_rows
from .models import Toy, toy_loss
from .oracle import (
    example_norms,
    flat_clipped_sum,
    group_clipped_sum,
    loop_grads,
    per_example_grads,
    sorted_norms,
)

#: the tolerance of every exact check unless a model computes in float32 inside (then the test says so)
RTOL, ATOL = 1e-7, 1e-10


# ------------------------------------------------------------------------------------------------ argument builders
def dp_args(tmp_path, per_device: int, ga: int = 1, max_norm: float = 1.0, seed: int = 0, **overrides
            ) -> DPTrainingArguments:
    """``DPTrainingArguments`` for ONE exact step: σ = 0, SGD with lr = 1, constant schedule, no weight decay, so the
    update is minus the released gradient; ``dp_seed=seed`` fixes the Poisson draw. Warnings (σ = 0 is not
    private) are silenced. ``overrides`` replace any of these."""
    base = dict(output_dir=str(tmp_path), noise_multiplier=0.0, per_sample_max_grad_norm=max_norm,
                per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, max_steps=1,
                learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True,
                report_to="none", save_strategy="no", dp_seed=seed, disable_tqdm=True)
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(**base)


def quick_dp_args(out, **overrides) -> DPTrainingArguments:
    """``DPTrainingArguments`` for a short CPU run with σ = 1 and C = 1, logging every step, saving nothing unless
    asked (``dp_self_check`` off: the run is about what the trainer reports, not coverage); the warning that a
    fixed or missing setting is not private is silenced. ``overrides`` replace any of these."""
    base = dict(output_dir=str(out), per_device_train_batch_size=4, noise_multiplier=1.0, max_steps=3, use_cpu=True,
                report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, learning_rate=1e-3,
                per_sample_max_grad_norm=1.0, dp_self_check=False)
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return DPTrainingArguments(**base)


def user_args(tmp_path, **overrides) -> DPTrainingArguments:
    """User-level DP (``privacy_unit="user"``, users in the ``author`` column of ``helpers.user_data``): one exact
    step (σ = 0, SGD lr 1), 3 users expected per step, ``dp_seed=5``."""
    base = dict(privacy_unit="user", user_id_column="author", per_sample_max_grad_norm=1.0, dp_seed=5)
    base.update(overrides)
    return dp_args(tmp_path, 3, **base)


def adam_args(tmp_path, **overrides) -> DPTrainingArguments:
    """DP-AdamBC (Tang et al. 2024) for three noisy steps: σ = 1, C = 0.5, AdamW with β = (0.9, 0.999)."""
    base = dict(output_dir=str(tmp_path), noise_multiplier=1.0, per_sample_max_grad_norm=0.5,
                per_device_train_batch_size=4, max_steps=3, learning_rate=0.01, optim="adamw_torch",
                lr_scheduler_type="constant", weight_decay=0.05, adam_beta1=0.9, adam_beta2=0.999,
                use_cpu=True, report_to="none", save_strategy="no", dp_seed=0, disable_tqdm=True,
                logging_strategy="no", dp_adam_bias_correction=True, dp_adam_bc_epsilon=1e-7, dp_self_check=False)
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return DPTrainingArguments(**base)


# ------------------------------------------------------------------------------------------------ exactness checks
def sampled_indices(n: int, q: float, ga: int, seed: int) -> list[int]:
    """The examples of the first step's Poisson draw for ``dp_seed=seed`` (the trainer's sampler, drawn again)."""
    sampler = PoissonBatchSampler(n, q, steps_per_epoch=1, num_chunks=ga, seed=seed)
    return [i for chunk in sampler for i in chunk]


def sampled_users(q: float = 0.6, seed: int = 5) -> tuple[list[int], list[str]]:
    """The rows of ``helpers.user_data`` in the first step's Poisson draw of users (the trainer's user sampler, drawn
    again; ``user_args``' seed) and each row's author."""
    from hf_dp.sampling import PoissonUserSampler

    users = np.unique(AUTHORS, return_inverse=True)[1]
    indices = next(iter(PoissonUserSampler(users, q, steps_per_epoch=2, num_chunks=1, seed=seed)))
    return indices, [AUTHORS[i] for i in indices]


def check_update(model, dataset, tmp_path, per_device: int, ga: int, clip_quantile: float = 0.5, seed: int = 3):
    """One Poisson-sampled DP step (flat clipping, σ = 0) equals the oracle's ``flat_clipped_sum`` / (q N) over the
    examples drawn; C at the ``clip_quantile`` of their norms (some clipped, some not). Returns the drawn indices."""
    model = model.double()
    n = len(dataset)
    expected_batch = per_device * ga
    q = expected_batch / n
    indices = sampled_indices(n, q, ga, seed)
    grads = per_example_grads(model, dataset, indices)
    norms = sorted(example_norms(grads))
    max_norm = norms[int(clip_quantile * (len(norms) - 1))]  # some examples clipped, some not
    expected = flat_clipped_sum(grads, max_norm)

    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, per_device, ga, max_norm, seed=seed), train_dataset=dataset)
    trainer.train()
    assert trainer.accountant.steps == 1
    for k, p in model.named_parameters():
        update = before[k] - p.detach()
        target = expected[k] / expected_batch if p.requires_grad else torch.zeros_like(update)
        torch.testing.assert_close(update, target, rtol=RTOL, atol=ATOL, msg=k)
    return indices


def check_exact(model: nn.Module, data, tmp_path, clipping: str = "flat", ga: int = 2, rtol: float = RTOL,
                per_example_loss=None, data_collator=None, oracle_loss=None, **overrides) -> DPTrainer:
    """One DP step over all of ``data`` (q = 1, σ = 0, ``ga`` micro-batches) equals the oracle's clipped sum / n.

    Flat: one threshold, just above the lower median of the examples' norms; per-layer (or any group-wise mode): the
    trainer's groups, each threshold just above that group's lower median (set on the trainer before the step), so
    some examples are clipped and some not. ``overrides`` go to ``dp_args``; ``rtol`` is for models that compute in
    float32 inside (atol then scales with it). ``oracle_loss(model, batch_of_one)``: the oracle's loss
    (``helpers.oracle.trainer_loss``; default the model's own)."""
    model = model.double()
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    grads = per_example_grads(model, data, loss=oracle_loss)
    n = len(grads)
    trainable = list(grads[0])
    max_norm = sorted_norms(grads, trainable)[n // 2 - 1] + 1e-9
    args = dp_args(tmp_path, n // ga, ga, max_norm, clipping=clipping, poisson_sampling=True, **overrides)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, per_example_loss=per_example_loss,
                        data_collator=data_collator)
    if clipping == "flat":
        groups, thresholds = [trainable], [max_norm]
    else:
        groups = [g.params for g in trainer.group_clipper.groups]
        thresholds = [sorted_norms(grads, names)[n // 2 - 1] + 1e-9 for names in groups]
        trainer.group_clipper.thresholds = torch.tensor(thresholds, dtype=torch.float64)
    expected = group_clipped_sum(grads, groups, thresholds)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    assert trainer.accountant.steps == 1
    atol = rtol * 1e-3 if rtol > RTOL else ATOL
    for k, p in model.named_parameters():
        target = expected[k] / n if p.requires_grad else torch.zeros_like(p)
        torch.testing.assert_close(before[k] - p.detach(), target, rtol=rtol, atol=atol, msg=k)
    return trainer


def train_toy(body: nn.Module, tmp_path, n: int = 4, ga: int = 1, seq_len: int = 4, **overrides) -> DPTrainer:
    """``Toy(body)`` trained one step on ``toy_rows`` (σ = 0, C = 1) with ``toy_loss``; the trainer."""
    model = Toy(body).double()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path, n // ga, ga, 1.0, **overrides),
                        train_dataset=toy_rows(n, seq_len), per_example_loss=toy_loss)
    trainer.train()
    return trainer


def group_norms(grads, groups: list[list[str]]) -> np.ndarray:
    """The examples' norms per group: an (examples × groups) array."""
    return np.array([[sorted_norms([g], names)[0] for names in groups] for g in grads])


def run_group_step(model, data, tmp_path, mode: str, per_device=2, ga=3, seed=3, thresholds=None, **overrides):
    """One Poisson-sampled step of group-wise clipping ``mode`` (σ = 0) equals ``group_clipped_sum`` over the drawn
    examples with the trainer's groups; ``thresholds="median"``: each group's median norm (set on the trainer).
    Returns ``(trainer, groups)``."""
    model = model.double()
    n = len(data)
    expected = per_device * ga
    indices = sampled_indices(n, expected / n, ga, seed)
    grads = per_example_grads(model, data, indices)
    args = dp_args(tmp_path, per_device, ga, 1.0, seed=seed, clipping=mode, **overrides)
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    groups = [g.params for g in trainer.group_clipper.groups]
    if thresholds == "median":  # per-group medians: some examples clipped in every group
        thresholds = np.median(group_norms(grads, groups), axis=0).tolist()
        trainer.group_clipper.thresholds = torch.tensor(thresholds, dtype=torch.float64)
    thresholds = trainer.group_clipper.thresholds.tolist()
    oracle = group_clipped_sum(grads, groups, thresholds)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    for k, p in model.named_parameters():
        target = oracle[k] / expected if p.requires_grad else torch.zeros_like(p)
        torch.testing.assert_close(before[k] - p.detach(), target, rtol=RTOL, atol=ATOL, msg=k)
    return trainer, groups


def check_engine(model: nn.Module, batch: torch.Tensor, loss_fn=lambda y: y.pow(2).sum(tuple(range(1, y.dim())))):
    """The clipping engine on a plain module, without the trainer: its per-example squared norms and its sums with
    random factors equal ``loop_grads`` (one example at a time), float64; no unclipped gradient is ever formed."""
    model = model.double()
    batch = batch.double() if batch.is_floating_point() else batch
    grads = loop_grads(model, list(batch), loss_fn)
    engine = ClippingEngine(model)
    with engine.record(batch.shape[0]):
        loss_fn(model(batch)).sum().backward()
    norms = engine.per_example_norms_sq()
    for n in engine.params:
        expected = torch.stack([g[n].pow(2).sum() for g in grads])
        torch.testing.assert_close(norms.get(n, torch.zeros_like(expected)), expected, rtol=1e-9, atol=1e-12, msg=n)
    factors = torch.rand(batch.shape[0], dtype=torch.float64)
    engine.accumulate_clipped(factors)
    sums = engine.pop_summed_grads()
    for n in engine.params:
        expected = sum(f * g[n] for f, g in zip(factors, grads))
        torch.testing.assert_close(sums[n], expected, rtol=1e-9, atol=1e-12, msg=n)
    assert all(p.grad is None for p in model.parameters())  # no unclipped gradient was ever formed
    assert all(p.requires_grad for p in engine.params.values())
    return engine


def assert_refused_before_any_release(trainer, match: str, error: type[Exception] = ValueError) -> None:
    """``trainer.train()`` raises ``error`` matching ``match`` before anything is released: the accountant counted no
    step and no parameter moved."""
    import pytest

    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    with pytest.raises(error, match=match):
        trainer.train()
    assert trainer.accountant.steps == 0
    for k, p in trainer.model.named_parameters():
        assert torch.equal(p, before[k]), k


def assert_updates_close(update: dict, expected: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter of ``expected`` agrees, by name; something is expected to move (a zero oracle proves nothing)."""
    assert any(float(e.abs().max()) > 0 for e in expected.values())
    for n in expected:
        torch.testing.assert_close(update[n], expected[n], rtol=rtol, atol=atol, msg=n)


# ------------------------------------------------------------------------------------------------ several processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close_distributed() -> None:
    """End a launched worker cleanly: every rank waits for the others, then the process group is destroyed.

    A gloo process group left alive at interpreter exit can abort one rank ("terminate called without an active
    exception", SIGABRT) after all the work is done; CI saw this once in the two-process SFT test.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def one_step_against_oracle(trainer, grads: list[dict[str, torch.Tensor]], expected_batch: int,
                            quantile: float = 0.5) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One DP step (σ = 0) with C at a ``quantile`` of the oracle's per-example (per-row, per-user) norms, so some
    are clipped and some not; returns ``(update, oracle update)`` keyed by the oracle's parameter names, the oracle's
    being ``-Σ clip_C(g_i) / expected_batch`` from ``grads`` (the oracle's own per-example gradients)."""
    norms = sorted(example_norms(grads))
    trainer.args.per_sample_max_grad_norm = norms[int(quantile * (len(norms) - 1))]
    clipped = flat_clipped_sum(grads, trainer.args.per_sample_max_grad_norm)
    expected = {n: -g / expected_batch for n, g in clipped.items()}
    params = dict(trainer.model.named_parameters())
    before = {n: params[n].detach().clone() for n in expected}
    trainer.train()
    assert trainer.accountant.steps == 1
    return {n: params[n].detach() - before[n] for n in expected}, expected
