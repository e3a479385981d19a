"""The DP mechanism as one object (``hf_dp/mechanism.py``): σ, q, B, N, δ, the accountant, the noise, the budget.

The oracles are independent of hf_dp: prv-accountant itself for ε, the closed forms of the noise-to-signal ratio
(σ·√d / (q·N), and / √T over a run) and of the released noise std (σ·S·γ_k / B, noise.py's allocations written out
here). The mechanism is built without a trainer (``DPTrainingArguments`` and a training set).
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

from hf_dp import DPTrainingArguments
from hf_dp.accounting import MechanismRecord
from hf_dp.mechanism import Mechanism
from hf_dp.plan import plan_privacy


def dp_args(tmp_path, **kw) -> DPTrainingArguments:
    base = dict(output_dir=str(tmp_path), noise_multiplier=1.1, per_sample_max_grad_norm=0.5,
                per_device_train_batch_size=25, gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainingArguments(**base)


def prv_upper(sigma: float, q: float, steps: int, delta: float) -> float:
    """prv-accountant's upper bound on ε for T Poisson-subsampled Gaussian steps (not hf_dp's accountant)."""
    prv = PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = PRVAccountant(prvs=[prv], eps_error=0.01, delta_error=delta / 1000, max_self_compositions=[steps])
        return acc.compute_epsilon(delta=delta, num_self_compositions=[steps])[2]


def test_quantities_and_banner_match_the_closed_forms_and_the_plan(tmp_path):
    """q = B/N, δ = 1/N^1.1, the banner's planned ε = prv-accountant's, its noise-to-signal ratios = σ·√d/(q·N) and
    that / √T; and the banner and ``plan_privacy`` are the same numbers (the plan's maths are written once)."""
    n, d, steps = 2000, 200_000, 40
    mech = Mechanism(dp_args(tmp_path), lambda: list(range(n)))
    assert mech.expected_batch_size == 50 and mech.num_units == n
    assert mech.sample_rate == 50 / n and mech.delta == pytest.approx(n ** -1.1)
    mech.begin_run(steps)
    block, advice = mech.plan_log(steps, d)
    ratio = 1.1 * math.sqrt(d) / 50  # σ·C·√d/(q·N) over C
    assert block["dp_noise_to_signal"] == round(ratio, 4)
    assert block["dp_noise_to_signal_over_run"] == round(ratio / math.sqrt(steps), 4)
    assert block["dp_planned_epsilon"] == pytest.approx(prv_upper(1.1, 50 / n, steps, n ** -1.1), abs=1e-4)
    assert advice is not None and "the noise dominates" in advice  # ratio/√T ≈ 1.56 > 1
    plan = mech.plan(steps, d)
    assert round(plan["epsilon"], 4) == block["dp_planned_epsilon"]
    assert round(plan["noise_to_signal"], 4) == block["dp_noise_to_signal"] and plan["advice"] == advice
    assert mech.accountant.steps == 0  # planning records nothing


def test_plan_earlier_steps_are_the_earlier_runs_only():
    """``earlier_steps`` counts the model's earlier DP steps, not the planned ones (the plan's accountant once
    appended the planned steps to the history list it was given)."""
    history = [MechanismRecord(1.0, 0.1, 5)]
    plan = plan_privacy(num_examples=100, per_device_train_batch_size=10, max_steps=7, noise_multiplier=1.0,
                        history=history)
    assert plan["earlier_steps"] == 5 and plan["steps"] == 7
    assert [m.steps for m in history] == [5]  # the caller's history is untouched
    fresh = plan_privacy(num_examples=100, per_device_train_batch_size=10, max_steps=7, noise_multiplier=1.0)
    assert fresh["earlier_steps"] == 0


def _groups(thresholds: list[float], dims: list[int]):
    params = {f"p{k}": torch.nn.Parameter(torch.zeros(dim)) for k, dim in enumerate(dims)}
    groups = [SimpleNamespace(name=f"g{k}", params=[f"p{k}"]) for k in range(len(dims))]
    clipper = SimpleNamespace(groups=groups, thresholds=torch.tensor(thresholds), adaptive=False,
                              num_groups=len(groups))
    return clipper, SimpleNamespace(params=params), params


@pytest.mark.parametrize("allocation", ["global", "equal_budget", "weighted"])
def test_released_noise_std_is_the_allocations_closed_form(tmp_path, allocation):
    """The noise std in each coordinate of the released gradient (what DP-AdamBC reads): σ·S·γ_k / B with the
    allocation's γ_k and sensitivity S = (Σ_k C_k² / γ_k²)^½ (global: γ = 1; equal budget: γ_k = C_k; weighted:
    γ_k = C_k / √d_k); flat clipping: σ·C / B."""
    sigma, thresholds, dims = 1.3, [0.3, 0.4], [4, 9]
    mech = Mechanism(dp_args(tmp_path, noise_multiplier=sigma, clipping="per_layer", noise_allocation=allocation),
                     lambda: list(range(500)))
    assert mech.released_noise_std() == pytest.approx(sigma * 0.5 / 50)  # no group clipper yet: flat
    clipper, engine, params = _groups(thresholds, dims)
    mech.set_clipping(clipper, engine)
    gammas = {"global": [1.0, 1.0], "equal_budget": thresholds,
              "weighted": [c / math.sqrt(d) for c, d in zip(thresholds, dims)]}[allocation]
    s = math.sqrt(sum((c / g) ** 2 for c, g in zip(thresholds, gammas)))
    expected = {id(params[f"p{k}"]): sigma * s * g / 50 for k, g in enumerate(gammas)}
    assert mech.released_noise_std() == pytest.approx(expected)


def test_budget_allows_exactly_the_steps_within_target(tmp_path):
    """With ``target_epsilon`` and a σ given by the checkpoint (here: set), the budget allows the largest n with
    ε(n) ≤ target (prv-accountant's ε), counted from the run's start; the stop marks the budget exhausted and calls
    the trainer's stop."""
    n, sigma = 1000, 0.8
    q, delta = 50 / n, n ** -1.1
    low, high = prv_upper(sigma, q, 20, delta), prv_upper(sigma, q, 21, delta)
    assert high - low > 0.02  # the target below lies well between ε(20) and ε(21)
    mech = Mechanism(dp_args(tmp_path, noise_multiplier=None, target_epsilon=(low + high) / 2), lambda: list(range(n)))
    mech.noise_multiplier = sigma  # as a resumed run's
    mech.begin_run(40)
    assert mech.allowed_steps == 20
    mech.accountant.step(sigma, q, 19)
    assert mech.budget_allows(1) and not mech.budget_allows(2)
    stopped = []
    mech.on_budget_stop = lambda: stopped.append(True)
    mech.stop_for_budget()
    assert mech.budget_exhausted and stopped == [True]
