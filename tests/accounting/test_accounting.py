"""Tests for hf_dp.accounting against independent oracles.

Oracles: published / previously measured reference values, prv_accountant used directly (PRVAccountant,
DPSGDAccountant, RDP, find_noise_multiplier), Opacus' accountants (imported here only), and the closed form of the
Gaussian mechanism's privacy curve (Balle & Wang 2018) for q = 1.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import time
import warnings

import pytest
from scipy import optimize
from scipy.stats import norm

from hf_dp.accounting import MechanismRecord, PrivacyAccountant, calibrate_noise_multiplier, group_privacy

prv_accountant = pytest.importorskip("prv_accountant")
from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant  # noqa: E402
from prv_accountant.dpsgd import DPSGDAccountant, find_noise_multiplier  # noqa: E402
from prv_accountant.other_accountants import RDP  # noqa: E402

DELTA = 1e-5


def _accountant(records: list[tuple[float, float, int]], **kwargs) -> PrivacyAccountant:
    acc = PrivacyAccountant(**kwargs)
    for sigma, q, n in records:
        acc.step(sigma, q, n)
    return acc


def _gaussian_delta(eps: float, mu: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/σ = mu (Balle & Wang 2018, Thm 8)."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def _gaussian_epsilon(delta: float, mu: float) -> float:
    return optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, 500.0, xtol=1e-12)


@pytest.fixture(scope="module")
def acc_1000() -> PrivacyAccountant:
    """σ=1.0, q=0.01, T=1000 (Opacus / prv-accountant's standard example)."""
    return _accountant([(1.0, 0.01, 1000)])


@pytest.fixture(scope="module")
def acc_hetero() -> PrivacyAccountant:
    return _accountant([(1.0, 0.01, 500), (0.8, 0.02, 500)])


@pytest.fixture(scope="module")
def calibrated_sigma() -> float:
    return calibrate_noise_multiplier(3.0, DELTA, 0.01, 1000)


# --------------------------------------------------------------------------------------------- reference values
def test_reference_values_sigma_1_5():
    """σ=1.5, q=0.04, 2250 steps, δ=1e-5: PRV ≈ 6.78 (upper bound), RDP ≈ 7.33 (Li et al. 2022-style setting)."""
    acc = _accountant([(1.5, 0.04, 2250)])
    eps_prv = acc.get_epsilon(DELTA)
    assert 6.7 <= eps_prv <= 6.85
    assert eps_prv == pytest.approx(6.779, abs=0.005)
    assert acc.get_epsilon(DELTA, accountant="rdp") == pytest.approx(7.33, abs=0.01)


def test_reference_values_sigma_1(acc_1000):
    lower, estimate, upper = acc_1000.get_epsilon_bounds(DELTA)
    assert (lower, estimate, upper) == pytest.approx((1.8181, 1.8282, 1.8384), abs=2e-4)
    assert upper - lower == pytest.approx(2 * 0.01, abs=1e-3)
    assert acc_1000.get_epsilon(DELTA) == upper  # PRV reports the conservative upper bound
    assert acc_1000.get_epsilon(DELTA, accountant="rdp") == pytest.approx(2.10137, abs=1e-5)
    assert PrivacyAccountant(accountant="rdp").accountant == "rdp"


# ----------------------------------------------------------------------------------- prv_accountant used directly
def test_equals_prv_accountant_homogeneous(acc_1000):
    direct = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=0.01, noise_multiplier=1.0)],
                           eps_error=0.01, delta_error=DELTA / 1000, max_self_compositions=[1000])
    expected = direct.compute_epsilon(delta=DELTA, num_self_compositions=[1000])
    assert acc_1000.get_epsilon_bounds(DELTA) == pytest.approx(expected, rel=1e-9)
    dpsgd = DPSGDAccountant(noise_multiplier=1.0, sampling_probability=0.01, max_steps=1000, eps_error=0.01,
                            delta_error=DELTA / 1000)
    assert acc_1000.get_epsilon(DELTA) == pytest.approx(dpsgd.compute_epsilon(delta=DELTA, num_steps=1000)[2], rel=1e-9)
    rdp = RDP(prvs=[PoissonSubsampledGaussianMechanism(0.01, 1.0)])
    assert acc_1000.get_epsilon(DELTA, "rdp") == pytest.approx(rdp.compute_epsilon(DELTA, [1000])[2], rel=1e-12)


def test_equals_prv_accountant_heterogeneous(acc_hetero):
    prvs = [PoissonSubsampledGaussianMechanism(0.01, 1.0), PoissonSubsampledGaussianMechanism(0.02, 0.8)]
    direct = PRVAccountant(prvs=prvs, eps_error=0.01, delta_error=DELTA / 1000, max_self_compositions=[500, 500])
    expected = direct.compute_epsilon(delta=DELTA, num_self_compositions=[500, 500])
    assert expected == pytest.approx((4.8318, 4.8421, 4.8524), abs=2e-4)  # measured reference
    assert acc_hetero.get_epsilon_bounds(DELTA) == pytest.approx(expected, rel=1e-9)
    assert acc_hetero.get_epsilon(DELTA) == pytest.approx(4.84, abs=0.02)
    assert acc_hetero.get_epsilon(DELTA, "rdp") == pytest.approx(RDP(prvs).compute_epsilon(DELTA, [500, 500])[2],
                                                                 rel=1e-12)


def test_non_consecutive_repeats_are_aggregated(acc_hetero):
    acc = _accountant([(1.0, 0.01, 300), (0.8, 0.02, 500), (1.0, 0.01, 200)])
    assert len(acc.history) == 3  # history keeps the order; the PRVs are aggregated per distinct (σ, q)
    assert acc.steps == 1000
    assert acc.get_epsilon_bounds(DELTA) == pytest.approx(acc_hetero.get_epsilon_bounds(DELTA), rel=1e-9)
    assert acc.get_epsilon(DELTA, "rdp") == pytest.approx(acc_hetero.get_epsilon(DELTA, "rdp"), rel=1e-12)
    swapped = _accountant([(0.8, 0.02, 500), (1.0, 0.01, 500)])  # composition is commutative
    assert swapped.get_epsilon(DELTA) == pytest.approx(acc_hetero.get_epsilon(DELTA), abs=1e-6)


def test_full_batch_q1_matches_gaussian_closed_form():
    """q = 1: T Gaussian steps with σ compose to one Gaussian mechanism with μ = sqrt(T)/σ (closed-form δ(ε))."""
    sigma, steps = 2.0, 10
    acc = _accountant([(sigma, 1.0, steps)])
    lower, estimate, upper = acc.get_epsilon_bounds(DELTA)
    exact = _gaussian_epsilon(DELTA, math.sqrt(steps) / sigma)
    assert lower <= exact <= upper
    assert estimate == pytest.approx(exact, abs=2e-3)
    direct = PRVAccountant(prvs=[GaussianMechanism(noise_multiplier=sigma)], eps_error=0.01,
                           delta_error=DELTA / 1000, max_self_compositions=[steps])
    assert (lower, estimate, upper) == pytest.approx(direct.compute_epsilon(DELTA, [steps]), rel=1e-9)
    subsampled = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(1.0, sigma)], eps_error=0.01,
                               delta_error=DELTA / 1000, max_self_compositions=[steps])
    assert upper == pytest.approx(subsampled.compute_epsilon(DELTA, [steps])[2], abs=1e-6)
    # RDP of the Gaussian mechanism is α T / (2σ²) (Mironov 2017, Prop. 7): check via the same conversion.
    assert acc.get_epsilon(DELTA, "rdp") == pytest.approx(
        RDP([GaussianMechanism(sigma)]).compute_epsilon(DELTA, [steps])[2], rel=1e-12)
    assert acc.get_epsilon(DELTA, "rdp") > upper
    # δ(ε) upper bound covers the exact δ, and is tight.
    eps = 1.5
    exact_delta = _gaussian_delta(eps, math.sqrt(steps) / sigma)
    assert exact_delta <= acc.get_delta(eps) <= _gaussian_delta(eps - 0.011, math.sqrt(steps) / sigma) + 1e-9


def test_get_delta_matches_prv_accountant(acc_1000):
    direct = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(0.01, 1.0)], eps_error=0.01,
                           delta_error=1e-10, max_self_compositions=[1000])
    expected = direct.compute_delta(epsilon=1.0, num_self_compositions=[1000])
    assert acc_1000.get_delta(1.0) == pytest.approx(expected[2], rel=1e-9)
    assert acc_1000.get_delta(1.0) == pytest.approx(0.002616, rel=0.07)  # reference estimate 0.002616
    assert acc_1000.get_delta(3.0) < acc_1000.get_delta(1.0)
    assert PrivacyAccountant().get_delta(1.0) == 0.0


# ------------------------------------------------------------------------------------------------ Opacus oracle
def test_cross_check_opacus(acc_1000, acc_hetero):
    opacus_acc = pytest.importorskip("opacus.accountants")
    for ours in (acc_1000, acc_hetero):
        history = [(r.noise_multiplier, r.sample_rate, r.steps) for r in ours.history]
        rdp = opacus_acc.RDPAccountant()
        rdp.history = list(history)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "optimal order is the largest alpha" for some settings
            assert ours.get_epsilon(DELTA, "rdp") == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-6)
        prv = opacus_acc.PRVAccountant()
        prv.history = list(history)
        assert ours.get_epsilon(DELTA) == pytest.approx(prv.get_epsilon(DELTA, eps_error=0.01), abs=2e-3)
    # Opacus merges consecutive identical steps exactly like we do.
    prv = opacus_acc.PRVAccountant()
    ours = PrivacyAccountant()
    for sigma in (1.0, 1.0, 0.9, 1.0):
        prv.step(noise_multiplier=sigma, sample_rate=0.01)
        ours.step(sigma, 0.01)
    assert [(r.noise_multiplier, r.sample_rate, r.steps) for r in ours.history] == prv.history


# --------------------------------------------------------------------------------------------------- calibration
def test_calibration_meets_target_and_is_minimal(calibrated_sigma):
    sigma, tol = calibrated_sigma, 0.01
    assert _accountant([(sigma, 0.01, 1000)]).get_epsilon(DELTA) <= 3.0
    assert _accountant([(sigma * (1 - tol), 0.01, 1000)]).get_epsilon(DELTA) > 3.0
    assert sigma == pytest.approx(0.8188, rel=0.01)


def test_calibration_matches_prv_accountant_and_opacus(calibrated_sigma):
    reference = find_noise_multiplier(sampling_probability=0.01, num_steps=1000, target_epsilon=3.0,
                                      target_delta=DELTA, eps_error=0.1)
    assert calibrated_sigma == pytest.approx(reference, rel=0.03)
    utils = pytest.importorskip("opacus.accountants.utils")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' RDP-based domain sizing warns "optimal order is the largest alpha"
        opacus_sigma = utils.get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=0.01,
                                                  steps=1000, accountant="prv")
    assert calibrated_sigma == pytest.approx(opacus_sigma, rel=0.03)


def test_calibration_rdp_matches_opacus():
    sigma = calibrate_noise_multiplier(3.0, DELTA, 0.01, 1000, accountant="rdp", tolerance=0.005)
    acc = PrivacyAccountant(accountant="rdp")
    acc.step(sigma, 0.01, 1000)
    assert acc.get_epsilon(DELTA) <= 3.0
    assert _accountant([(sigma * 0.995, 0.01, 1000)]).get_epsilon(DELTA, "rdp") > 3.0
    utils = pytest.importorskip("opacus.accountants.utils")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opacus_sigma = utils.get_noise_multiplier(target_epsilon=3.0, target_delta=DELTA, sample_rate=0.01,
                                                  steps=1000, accountant="rdp")
    assert sigma == pytest.approx(opacus_sigma, rel=0.01)


def test_calibration_is_fast():
    start = time.perf_counter()
    sigma = calibrate_noise_multiplier(2.0, DELTA, 0.02, 1000)
    assert time.perf_counter() - start < 15.0  # typically ~1-2 s on 2 cores (generous for loaded CI machines)
    assert _accountant([(sigma, 0.02, 1000)]).get_epsilon(DELTA) <= 2.0


def test_calibration_with_history():
    history = [MechanismRecord(1.2, 0.01, 300)]
    spent = _accountant([(1.2, 0.01, 300)]).get_epsilon(DELTA)
    sigma = calibrate_noise_multiplier(2.0, DELTA, 0.02, 300, history=history)
    both = _accountant([(1.2, 0.01, 300), (sigma, 0.02, 300)])
    assert spent < both.get_epsilon(DELTA) <= 2.0
    assert _accountant([(1.2, 0.01, 300), (sigma * 0.99, 0.02, 300)]).get_epsilon(DELTA) > 2.0
    alone = calibrate_noise_multiplier(2.0, DELTA, 0.02, 300)
    assert sigma > alone  # spending budget beforehand forces more noise


def test_calibration_full_batch():
    sigma = calibrate_noise_multiplier(1.0, DELTA, 1.0, 5)
    mu = math.sqrt(5) / sigma
    assert _gaussian_epsilon(DELTA, mu) <= 1.0  # the closed form agrees that the target is met
    assert _accountant([(sigma, 1.0, 5)]).get_epsilon(DELTA) <= 1.0 < _accountant(
        [(sigma * 0.99, 1.0, 5)]).get_epsilon(DELTA)


def test_calibration_errors():
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(0.0, DELTA, 0.01, 100)
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(-1.0, DELTA, 0.01, 100)
    with pytest.raises(ValueError, match="eps_error"):
        calibrate_noise_multiplier(0.005, DELTA, 0.01, 100)
    with pytest.raises(ValueError, match="history alone"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 100, history=[MechanismRecord(1.0, 0.01, 1000)])
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 100, history=[MechanismRecord(0.0, 0.01, 1)])
    with pytest.raises(ValueError, match="sample_rate"):
        calibrate_noise_multiplier(1.0, DELTA, 0.0, 100)
    with pytest.raises(ValueError, match="steps"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 0)
    with pytest.raises(ValueError, match="target_delta"):
        calibrate_noise_multiplier(1.0, 0.0, 0.01, 100)
    with pytest.raises(ValueError, match="accountant"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 100, accountant="gdp")
    with pytest.raises(ValueError, match="tolerance"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 100, tolerance=0.0)


# ------------------------------------------------------------------------------------------ history and state
def test_merging_of_consecutive_steps():
    acc = PrivacyAccountant()
    for _ in range(3):
        acc.step(1.0, 0.01)
    acc.step(1.0, 0.01, num_steps=7)
    acc.step(1.0, 0.01, num_steps=0)  # no-op
    assert acc.history == [MechanismRecord(1.0, 0.01, 10)]
    acc.step(1.0, 0.02)
    acc.step(0.9, 0.02, 2)
    acc.step(1.0, 0.01)
    assert acc.history == [MechanismRecord(1.0, 0.01, 10), MechanismRecord(1.0, 0.02, 1),
                           MechanismRecord(0.9, 0.02, 2), MechanismRecord(1.0, 0.01, 1)]
    assert acc.steps == 14


def test_state_dict_json_round_trip(acc_hetero):
    acc = acc_hetero.copy()
    acc.step(1.1, 0.01, 10)
    state = json.loads(json.dumps(acc.state_dict()))
    assert state["accountant"] == "prv" and state["eps_error"] == 0.01 and state["delta_error"] is None
    assert state["prv_accountant_version"] == importlib.metadata.version("prv-accountant")
    assert state["history"][0] == {"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 500}
    restored = PrivacyAccountant(accountant="rdp", eps_error=0.1)
    restored.load_state_dict(state)
    assert restored.history == acc.history
    assert (restored.accountant, restored.eps_error, restored.delta_error) == ("prv", 0.01, None)
    assert restored.get_epsilon(DELTA, "rdp") == acc.get_epsilon(DELTA, "rdp")
    restored.step(1.1, 0.01)
    assert restored.history[-1].steps == 11  # merging continues after a restore

    custom = PrivacyAccountant(accountant="rdp", eps_error=0.05, delta_error=1e-9)
    custom.step(1.0, 0.5, 3)
    again = PrivacyAccountant()
    again.load_state_dict(json.loads(json.dumps(custom.state_dict())))
    assert (again.accountant, again.eps_error, again.delta_error, again.history) == (
        "rdp", 0.05, 1e-9, custom.history)


def test_load_state_dict_validation():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.01, 5)
    with pytest.raises(ValueError):
        acc.load_state_dict({"accountant": "prv"})
    with pytest.raises(ValueError):
        acc.load_state_dict({"history": [{"noise_multiplier": 1.0, "sample_rate": 2.0, "steps": 1}]})
    with pytest.raises(ValueError):
        acc.load_state_dict({"history": [{"noise_multiplier": 1.0}]})
    assert acc.history == [MechanismRecord(1.0, 0.01, 5)]  # unchanged on error
    state = acc.state_dict()
    state["prv_accountant_version"] = "0.0.1"
    with pytest.warns(UserWarning, match="prv-accountant"):
        acc.load_state_dict(state)


def test_copy_is_independent():
    acc = _accountant([(1.0, 0.01, 10)])
    dup = acc.copy()
    dup.step(1.0, 0.01, 5)
    dup.step(2.0, 0.01, 5)
    assert acc.history == [MechanismRecord(1.0, 0.01, 10)]
    assert dup.steps == 20 and acc.steps == 10
    assert (dup.accountant, dup.eps_error, dup.delta_error) == (acc.accountant, acc.eps_error, acc.delta_error)


def test_results_are_cached(acc_1000):
    first = acc_1000.get_epsilon(DELTA)
    start = time.perf_counter()
    for _ in range(100):
        assert acc_1000.get_epsilon(DELTA) == first
        assert _accountant([(1.0, 0.01, 1000)]).get_epsilon(DELTA) == first
    assert time.perf_counter() - start < 0.5


# ----------------------------------------------------------------------------------------- edge cases, errors
def test_empty_history_and_zero_noise():
    acc = PrivacyAccountant()
    assert acc.steps == 0
    assert acc.get_epsilon(DELTA) == 0.0 and acc.get_epsilon(DELTA, "rdp") == 0.0
    assert acc.get_epsilon_bounds(DELTA) == (0.0, 0.0, 0.0)
    acc.step(1.0, 0.01, 10)
    acc.step(0.0, 0.01)
    assert acc.get_epsilon(DELTA) == math.inf
    assert acc.get_epsilon(DELTA, "rdp") == math.inf
    assert acc.get_epsilon_bounds(DELTA) == (math.inf, math.inf, math.inf)
    assert acc.get_delta(10.0) == 1.0


def test_small_noise_falls_back_to_rdp_with_warning():
    acc = _accountant([(0.1, 0.01, 1000)])  # ε in the thousands: prv-accountant's domain would need 2e8 points
    with pytest.warns(RuntimeWarning, match="RDP"):
        eps = acc.get_epsilon(DELTA)
    assert eps == acc.get_epsilon(DELTA, "rdp") > 1000


def test_validation_errors():
    acc = PrivacyAccountant()
    for bad in [dict(noise_multiplier=-1.0, sample_rate=0.1), dict(noise_multiplier=float("nan"), sample_rate=0.1),
                dict(noise_multiplier=float("inf"), sample_rate=0.1)]:
        with pytest.raises(ValueError, match="noise_multiplier"):
            acc.step(**bad)
    for q in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sample_rate"):
            acc.step(1.0, q)
    for n in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="num_steps"):
            acc.step(1.0, 0.1, n)
    assert acc.history == []
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(accountant="gdp")
    with pytest.raises(ValueError, match="eps_error"):
        PrivacyAccountant(eps_error=0.0)
    with pytest.raises(ValueError, match="delta_error"):
        PrivacyAccountant(delta_error=0.0)
    acc.step(1.0, 0.1)
    with pytest.raises(ValueError, match="accountant"):
        acc.get_epsilon(DELTA, accountant="GDP")
    for delta in (0.0, 1.0, -1e-5):
        with pytest.raises(ValueError, match="delta"):
            acc.get_epsilon(delta)
    with pytest.raises(ValueError, match="epsilon"):
        acc.get_delta(-1.0)
    with pytest.raises(ValueError, match="delta_error"):
        _accountant([(1.0, 0.1, 1)], delta_error=1e-3).get_epsilon(1e-4)
    with pytest.raises(ValueError):
        MechanismRecord(1.0, 0.01, -3)


def test_monotonicity():
    for accountant in ("prv", "rdp"):
        by_steps = [_accountant([(1.0, 0.01, n)]).get_epsilon(DELTA, accountant) for n in (100, 200, 400, 800)]
        assert by_steps == sorted(by_steps) and len(set(by_steps)) == 4
        by_sigma = [_accountant([(s, 0.01, 400)]).get_epsilon(DELTA, accountant) for s in (0.8, 1.0, 1.5, 3.0)]
        assert by_sigma == sorted(by_sigma, reverse=True) and len(set(by_sigma)) == 4
        by_rate = [_accountant([(1.0, q, 400)]).get_epsilon(DELTA, accountant) for q in (0.005, 0.01, 0.02)]
        assert by_rate == sorted(by_rate)
    acc = _accountant([(1.0, 0.01, 400)])
    assert acc.get_epsilon(1e-6) > acc.get_epsilon(1e-5) > acc.get_epsilon(1e-3)
    assert acc.get_epsilon(DELTA) < acc.get_epsilon(DELTA, "rdp")  # PRV is tighter than RDP


# ------------------------------------------------------------------------------------------------ group privacy
def test_group_privacy_formula():
    eps, delta = 1.0, 1e-6
    for k in (1, 2, 5):
        g_eps, g_delta = group_privacy(eps, delta, k)
        assert g_eps == pytest.approx(k * eps)
        assert g_delta == pytest.approx(k * math.exp((k - 1) * eps) * delta)
    g_eps, g_delta = group_privacy(eps, delta, 4)
    assert g_eps != pytest.approx(eps / 4) and g_eps > eps  # not ε/k: privacy degrades for groups
    assert g_delta > delta
    assert group_privacy(2.0, 1e-5, 100) == (200.0, 1.0)  # δ is capped at 1 (and computed without overflow)
    assert group_privacy(0.5, 0.0, 3) == (1.5, 0.0)
    for args in [(-1.0, 1e-5, 2), (1.0, 1.5, 2), (1.0, 1e-5, 0), (1.0, 1e-5, 2.5)]:
        with pytest.raises(ValueError):
            group_privacy(*args)


# ------------------------------------------------------------------ where prv-accountant fails: the PLD accountant
def _independent_pld_epsilon(records: list[tuple[float, float, int]], delta: float) -> float:
    """ε of dp_accounting's PLD accountant used directly, on a finer grid (1e-4) than hf_dp's (1e-3)."""
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=1e-4)
    for sigma, q, n in records:
        acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), n))
    return acc.get_epsilon(delta)


def _prv_fails(sigma: float, q: float, steps: int, delta: float) -> bool:
    try:
        PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(q, sigma)], max_self_compositions=[steps],
                      eps_error=0.01, delta_error=delta / 1000).compute_epsilon(delta, [steps])
    except (ValueError, RuntimeError, ArithmeticError, AssertionError):
        return True
    return False


@pytest.mark.parametrize("records", [[(0.62, 0.128, 16)], [(0.5, 0.1, 30)], [(0.62, 0.128, 16), (0.9, 0.05, 40)]])
def test_pld_where_prv_fails_is_an_upper_bound_not_rdp(records):
    delta = 1 / 2000**1.1
    assert _prv_fails(*records[0], delta)  # the regime of issue 15 (prv-accountant 0.2 raises)
    acc = _accountant(records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RDP fallback warning
        eps = acc.get_epsilon(delta)
    assert acc.accountant_used == "pld (prv-accountant failed numerically)"
    reference = _independent_pld_epsilon(records, delta)
    assert reference <= eps <= reference + 0.01  # never below the finer independent PLD; as tight
    assert eps < acc.get_epsilon(delta, "rdp") and acc.accountant_used == "rdp"
    acc.planned_steps = acc.steps + 10  # the logging path (one discretisation for the planned run) also falls back
    assert acc.get_epsilon(delta) == eps and acc.accountant_used.startswith("pld")
    assert acc.get_delta(eps) <= delta * 1.001 and acc.accountant_used.startswith("pld")


def test_calibration_in_the_failing_prv_regime_reaches_the_target():
    """Issue 15: calibration used to stop at the smallest σ where PRV works (ε = 6.8 of 8 here)."""
    delta, q, steps, target = 1 / 2000**1.1, 0.128, 16, 8.0
    sigma = calibrate_noise_multiplier(target, delta, q, steps)
    assert _prv_fails(sigma, q, steps, delta)
    acc = _accountant([(sigma, q, steps)])
    eps = acc.get_epsilon(delta)
    assert acc.accountant_used.startswith("pld")
    assert 0.975 * target <= eps <= target
    assert _independent_pld_epsilon([(sigma, q, steps)], delta) <= eps
    assert _accountant([(sigma * 0.99, q, steps)]).get_epsilon(delta) > target  # minimal within the tolerance


def test_accountant_eps_error_is_named_in_the_error():
    with pytest.raises(ValueError, match="accountant_eps_error"):
        calibrate_noise_multiplier(0.005, DELTA, 0.01, 100)
