"""Privacy accounting for DP-SGD: Poisson-subsampled Gaussian steps, ε(δ) by PRV (PLD where PRV fails) or RDP.

Every optimiser step of DP-SGD is one run of the Poisson-subsampled Gaussian mechanism with noise multiplier σ and
sampling rate q. :class:`PrivacyAccountant` records these steps and converts the composition into an (ε, δ)
guarantee with one of two accountants, as in Li et al. 2022, "Large Language Models Can Be Strong Differentially
Private Learners", Appendix B (PRV and RDP accounting):

* ``"prv"`` (default): numerical composition of privacy loss random variables, Gopi, Lee & Wutschitz 2021,
  "Numerical Composition of Differential Privacy" (NeurIPS 2021), via the ``prv_accountant`` package. The PRV
  accountant returns (lower, estimate, upper) bounds on ε whose width is ``2 * eps_error``; :meth:`get_epsilon`
  reports the **upper** bound so that the reported guarantee is conservative.
* ``"rdp"``: Rényi differential privacy, Mironov 2017, "Rényi Differential Privacy" (CSF 2017), with the sampled
  Gaussian RDP of Mironov, Talwar & Zhang 2019 and the RDP → (ε, δ) conversion of Canonne, Kamath & Steinke 2020
  (``prv_accountant.other_accountants.RDP``, identical to TF-Privacy's and Opacus' RDP accountants). RDP is
  always a valid upper bound but looser than PRV.

:func:`calibrate_noise_multiplier` finds the smallest σ that meets a target (ε, δ), and :func:`group_privacy`
converts a record-level guarantee into a group-level one.

Notes on ``prv_accountant`` 0.2.0 that this module works around:

* The discretisation domain is sized from an RDP bound; for small σ (large ε) it can have 10^8+ points and exhaust
  memory. The number of points is capped (:data:`MAX_DOMAIN_POINTS`) by raising ``eps_error`` just enough, which
  keeps the upper bound valid (only looser).
* ``prv_accountant`` fails numerically for small σ at large q (e.g. σ = 0.62, q = 0.128, 16 steps: "Discrete mean
  differs from continuous mean significantly"), for astronomically large ε (domain half-width above
  :data:`MAX_DOMAIN_HALF_WIDTH`, where ``exp`` overflows) and when δ is so small that floating-point error
  dominates. ε is then computed with another tight accountant: the privacy loss distribution (PLD) of Google's
  ``dp_accounting`` (Koskela, Jälkö & Honkela 2020, "Computing Tight Differential Privacy Guarantees Using FFT";
  Doroshenko et al. 2022, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions") with
  its *pessimistic* discretisation, an upper bound on ε for the add-or-remove-one relation (the larger of the add
  and the remove PLDs), at a grid of :func:`pld_discretization` (``eps_error / 10``). Only if that fails too (or
  RDP already bounds ε above :data:`PLD_MAX_EPSILON`, where the PLD grid would be huge and ε meaningless) is the
  looser RDP bound reported, with a ``RuntimeWarning``. :attr:`PrivacyAccountant.accountant_used` names the
  accountant that produced the last number.
* Results are cached in-process (LRU keyed by the aggregated mechanisms, δ/ε, accountant and error settings), so
  repeated logging of ε is cheap.
"""

from __future__ import annotations

import copy as _copy
import functools
import math
import operator
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PrivacyRandomVariable, PRVAccountant
from prv_accountant.accountant import compute_safe_domain_size
from prv_accountant.other_accountants import RDP
from scipy import optimize

__all__ = [
    "ACCOUNTANTS",
    "MechanismRecord",
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "group_privacy",
]

ACCOUNTANTS: tuple[str, ...] = ("prv", "rdp")
"""Names accepted for ``accountant``."""

MAX_DOMAIN_POINTS: int = 2**20
"""Cap on the number of discretisation points of one PRV computation (~1M points: ~4 s, ~0.5 GB)."""

MAX_DOMAIN_HALF_WIDTH: float = 5000.0
"""Above this PRV domain half-width (an RDP bound on ε at δ_error/4) the PRV is not computed (RDP is used)."""

STATE_DICT_VERSION: int = 1

PLD_MAX_EPSILON: float = 100.0
"""Above this RDP bound on ε the PLD fallback is skipped (its grid would be huge) and the RDP bound is reported."""

PRV = "prv"
PLD_FALLBACK = "pld (prv-accountant failed numerically)"
RDP_NAME = "rdp"
RDP_FALLBACK = "rdp (prv-accountant and pld failed numerically)"

_PLD_MAX_POINTS = 4e6  # cap on one step's PLD grid (~(20/σ + 1/σ²) / interval points)
_COARSE_EPS_ERROR = 0.1  # eps_error used while bracketing in calibrate_noise_multiplier
_COARSE_MAX_DOMAIN_POINTS = 2**18
_SIGMA_MIN = 1e-2  # calibration search range for the noise multiplier
_SIGMA_MAX = 1e4
_GET_DELTA_DEFAULT_DELTA_ERROR = 1e-10  # get_delta has no δ to derive δ_error from
_RDP_ORDERS = np.array([1.0 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)

_Mechanisms = tuple[tuple[float, float, int], ...]  # distinct (sigma, q, count), in first-occurrence order


def _prv_accountant_version() -> str:
    try:
        return metadata.version("prv-accountant")
    except metadata.PackageNotFoundError:  # pragma: no cover - only for unusual installs
        return "unknown"


# ----------------------------------------------------------------------------------------------------- validation
def _check_noise_multiplier(noise_multiplier: Any) -> float:
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}.")
    return sigma


def _check_sample_rate(sample_rate: Any) -> float:
    q = float(sample_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}.")
    return q


def _check_steps(steps: Any, name: str = "num_steps", minimum: int = 0) -> int:
    if isinstance(steps, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}.")
    try:
        n = operator.index(steps)
    except TypeError:
        if isinstance(steps, float) and steps.is_integer():
            n = int(steps)
        else:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}.") from None
    if n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {steps!r}.")
    return n


def _check_accountant(accountant: Any) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")
    return accountant


def _check_delta(delta: Any, name: str = "delta") -> float:
    d = float(delta)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}.")
    return d


def _check_eps_error(eps_error: Any) -> float:
    e = float(eps_error)
    if not (math.isfinite(e) and e > 0):
        raise ValueError(f"eps_error must be a finite number > 0, got {eps_error!r}.")
    return e


# ---------------------------------------------------------------------------------------------------- data model
@dataclass
class MechanismRecord:
    """One run of identical DP-SGD steps: ``steps`` Poisson-subsampled Gaussian mechanisms.

    Attributes:
        noise_multiplier: σ, the noise standard deviation divided by the clipping norm (sensitivity).
        sample_rate: q, the Poisson sampling probability of each record.
        steps: Number of consecutive steps with this (σ, q).
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        self.noise_multiplier = _check_noise_multiplier(self.noise_multiplier)
        self.sample_rate = _check_sample_rate(self.sample_rate)
        self.steps = _check_steps(self.steps, "steps")


def _aggregate(records: Any) -> _Mechanisms:
    """Distinct (σ, q) with their total step counts (equal mechanisms merged even if not consecutive)."""
    counts: dict[tuple[float, float], int] = {}
    for sigma, q, n in records:
        if n > 0:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + n
    return tuple((sigma, q, n) for (sigma, q), n in counts.items())


def _make_prv(sigma: float, q: float) -> PrivacyRandomVariable:
    # Without subsampling the mechanism is the plain Gaussian mechanism (prv_accountant's subsampled PRV also
    # handles q == 1, to ~1e-11, but the Gaussian PRV is exact and cheaper).
    if q == 1.0:
        return GaussianMechanism(noise_multiplier=sigma)
    return PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)


# ------------------------------------------------------------------------------------------------ PRV computations
class _PRVNumericalError(RuntimeError):
    """prv_accountant could not compute this composition reliably."""


def _build_prv_accountant(mechs: _Mechanisms, eps_error: float, delta_error: float,
                          max_points: int) -> tuple[PRVAccountant, list[int]]:
    prvs = [_make_prv(sigma, q) for sigma, q, _ in mechs]
    counts = [n for _, _, n in mechs]
    with np.errstate(all="ignore"):
        half_width = compute_safe_domain_size(prvs, counts, eps_error=eps_error, delta_error=delta_error)
        if not (math.isfinite(float(half_width)) and float(half_width) <= MAX_DOMAIN_HALF_WIDTH):
            raise _PRVNumericalError(f"PRV domain half-width {float(half_width):.4g} is too large (epsilon is huge).")
        # Same mesh as PRVAccountant (Gopi et al. 2021, Thm 5.5); cap the number of points by coarsening eps_error.
        mesh = eps_error / math.sqrt(sum(counts) / 2 * math.log(12 / delta_error))
        n_points = 2 * float(half_width) / mesh
        if n_points > max_points:
            eps_error = eps_error * n_points / max_points
            half_width = compute_safe_domain_size(prvs, counts, eps_error=eps_error, delta_error=delta_error)
        with warnings.catch_warnings():
            # Passing the domain size as eps_max (it is exactly what PRVAccountant would compute itself) avoids
            # computing the RDP bounds twice; PRVAccountant warns about a user-supplied eps_max.
            warnings.filterwarnings("ignore", message="Assuming that true epsilon", category=UserWarning)
            acc = PRVAccountant(prvs=prvs, eps_error=eps_error, delta_error=delta_error,
                                max_self_compositions=counts, eps_max=half_width)
    return acc, counts


@functools.lru_cache(maxsize=1024)
def _prv_epsilon_bounds(mechs: _Mechanisms, delta: float, eps_error: float, delta_error: float,
                        max_points: int = MAX_DOMAIN_POINTS) -> tuple[float, float, float]:
    """PRV (lower, estimate, upper) ε for mechanisms with σ > 0, clipped at 0. Raises _PRVNumericalError."""
    try:
        acc, counts = _build_prv_accountant(mechs, eps_error, delta_error, max_points)
        with np.errstate(all="ignore"):
            bounds = acc.compute_epsilon(delta=delta, num_self_compositions=counts)
    except _PRVNumericalError:
        raise
    except (ValueError, RuntimeError, ArithmeticError, AssertionError) as err:
        raise _PRVNumericalError(f"prv_accountant failed: {err}") from err
    lower, estimate, upper = (max(0.0, float(b)) for b in bounds)
    if not all(math.isfinite(b) for b in (lower, estimate, upper)):
        raise _PRVNumericalError(f"prv_accountant returned non-finite bounds {bounds}.")
    return lower, estimate, upper


@functools.lru_cache(maxsize=16)
def _planned_prv(sigma: float, q: float, planned: int, eps_error: float, delta_error: float) -> PRVAccountant:
    return _build_prv_accountant(((sigma, q, planned),), eps_error, delta_error, MAX_DOMAIN_POINTS)[0]


@functools.lru_cache(maxsize=4096)
def _planned_prv_epsilon(sigma: float, q: float, planned: int, steps: int, delta: float, eps_error: float,
                         delta_error: float) -> float:
    """Upper bound on ε after ``steps`` of one mechanism, from the discretisation sized for ``planned`` steps."""
    try:
        acc = _planned_prv(sigma, q, planned, eps_error, delta_error)
        with np.errstate(all="ignore"):
            upper = float(acc.compute_epsilon(delta=delta, num_self_compositions=[steps])[2])
    except _PRVNumericalError:
        raise
    except (ValueError, RuntimeError, ArithmeticError, AssertionError) as err:
        raise _PRVNumericalError(f"prv_accountant failed: {err}") from err
    if not math.isfinite(upper):
        raise _PRVNumericalError(f"prv_accountant returned a non-finite bound {upper}.")
    return max(0.0, upper)


@functools.lru_cache(maxsize=1024)
def _prv_delta_bounds(mechs: _Mechanisms, epsilon: float, eps_error: float,
                      delta_error: float) -> tuple[float, float, float]:
    """PRV (lower, estimate, upper) δ(ε), clipped to [0, 1]. Raises _PRVNumericalError."""
    try:
        acc, counts = _build_prv_accountant(mechs, eps_error, delta_error, MAX_DOMAIN_POINTS)
        with np.errstate(all="ignore"):
            bounds = acc.compute_delta(epsilon=epsilon, num_self_compositions=counts)
    except _PRVNumericalError:
        raise
    except (ValueError, RuntimeError, ArithmeticError, AssertionError) as err:
        raise _PRVNumericalError(f"prv_accountant failed: {err}") from err
    if not all(math.isfinite(b) for b in bounds):
        raise _PRVNumericalError(f"prv_accountant returned non-finite bounds {bounds}.")
    lower, estimate, upper = (min(1.0, max(0.0, float(b))) for b in bounds)
    return lower, estimate, upper


@functools.lru_cache(maxsize=4096)
def _rdp_curve(sigma: float, q: float) -> np.ndarray:
    """RDP of one step at the default orders (prv_accountant / TF-Privacy / Opacus orders)."""
    rdp = RDP(prvs=[_make_prv(sigma, q)], orders=list(_RDP_ORDERS))
    return rdp.rdps[0]


@functools.lru_cache(maxsize=1024)
def _rdp_epsilon(mechs: _Mechanisms, delta: float) -> float:
    """RDP upper bound on ε, identical to ``prv_accountant.other_accountants.RDP(...).compute_epsilon``."""
    rdp = RDP(prvs=[], orders=list(_RDP_ORDERS))
    rdp.rdps = [_rdp_curve(sigma, q) for sigma, q, _ in mechs]
    _, _, eps = rdp.compute_epsilon(delta=delta, num_self_compositions=[n for _, _, n in mechs])
    return max(0.0, float(eps))


def _rdp_delta(mechs: _Mechanisms, epsilon: float) -> float:
    """RDP upper bound on δ(ε): the same conversion as :func:`_rdp_epsilon`, solved for δ."""
    total = sum(_rdp_curve(sigma, q) * n for sigma, q, n in mechs)
    a = _RDP_ORDERS
    with np.errstate(all="ignore"):
        log_delta = (a - 1) * (total - epsilon + np.log1p(-1 / a)) - np.log(a)
    return float(min(1.0, np.exp(np.nanmin(log_delta))))


# ------------------------------------------------------------------------------------------------ PLD computations
def pld_discretization(eps_error: float) -> float:
    """Value discretisation interval of the PLD fallback for a requested precision ``eps_error``.

    ``eps_error / 10``, within [1e-5, 1e-2]: the pessimistic PLD is an upper bound at any interval; a finer one
    only makes it tighter (at eps_error = 0.01, i.e. 1e-3, within 1e-3 of the 1e-4 result for 16-1000 steps).
    """
    return min(max(eps_error / 10, 1e-5), 1e-2)


def _pld_of(mechs: _Mechanisms, interval: float):
    for sigma, _, _ in mechs:
        # One step's privacy loss spans ~(20/σ + 1/σ²) (the Gaussian truncated at mass e^-50): grid points / interval.
        if (20 / sigma + 1 / sigma**2) / interval > _PLD_MAX_POINTS:
            raise _PRVNumericalError(f"noise_multiplier={sigma:.3g} is too small for a PLD grid of {interval:g}.")
    composed = None
    for sigma, q, n in mechs:
        one = _pld.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval,
                                           pessimistic_estimate=True).self_compose(n)
        composed = one if composed is None else composed.compose(one)
    return composed


def _pld_value(mechs: _Mechanisms, interval: float, method: str, arg: float, what: str) -> float:
    """``pld.<method>(arg)`` of the pessimistic PLD; any numerical failure becomes _PRVNumericalError."""
    try:
        with np.errstate(all="ignore"):
            value = float(getattr(_pld_of(mechs, interval), method)(arg))
    except _PRVNumericalError:
        raise
    except (ValueError, RuntimeError, ArithmeticError, AssertionError, MemoryError) as err:
        raise _PRVNumericalError(f"dp_accounting PLD failed: {err}") from err
    if not math.isfinite(value):
        raise _PRVNumericalError(f"dp_accounting PLD returned a non-finite {what} {value}.")
    return value


@functools.lru_cache(maxsize=1024)
def _pld_epsilon(mechs: _Mechanisms, delta: float, interval: float) -> float:
    """Pessimistic-PLD upper bound on ε(δ) (``dp_accounting``, add-or-remove-one). Raises _PRVNumericalError."""
    if _rdp_epsilon(mechs, delta) > PLD_MAX_EPSILON:
        raise _PRVNumericalError(f"epsilon > {PLD_MAX_EPSILON:g} (RDP bound): the PLD is not computed.")
    return max(0.0, _pld_value(mechs, interval, "get_epsilon_for_delta", delta, "epsilon"))


@functools.lru_cache(maxsize=1024)
def _pld_delta(mechs: _Mechanisms, epsilon: float, interval: float) -> float:
    """Pessimistic-PLD upper bound on δ(ε). Raises _PRVNumericalError."""
    return min(1.0, max(0.0, _pld_value(mechs, interval, "get_delta_for_epsilon", epsilon, "delta")))


def _tight_epsilon(mechs: _Mechanisms, delta: float, eps_error: float, delta_error: float,
                   prv: Any = None) -> tuple[float, str]:
    """ε upper bound and the accountant that produced it: PRV (``prv()`` or the PRV upper bound), else the
    pessimistic PLD, else RDP (with a RuntimeWarning)."""
    try:
        if prv is not None:
            return prv(), PRV
        return _prv_epsilon_bounds(mechs, delta, eps_error, delta_error)[2], PRV
    except _PRVNumericalError as prv_err:
        try:
            return _pld_epsilon(mechs, delta, pld_discretization(eps_error)), PLD_FALLBACK
        except _PRVNumericalError as pld_err:
            warnings.warn(f"PRV accounting failed ({prv_err}) and so did the PLD accountant ({pld_err}); reporting "
                          "the (looser) RDP upper bound instead.", RuntimeWarning, stacklevel=3)
            return _rdp_epsilon(mechs, delta), RDP_FALLBACK


# -------------------------------------------------------------------------------------------------- accountant
class PrivacyAccountant:
    """History of Poisson-subsampled Gaussian steps (DP-SGD) and epsilon(delta) by PRV or RDP.

    Consecutive steps with identical (σ, q) are merged into one :class:`MechanismRecord`. Both accountants can
    always be queried; ``accountant`` only sets the default of :meth:`get_epsilon`.

    Example:
        >>> acc = PrivacyAccountant()
        >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
        >>> round(acc.get_epsilon(1e-5), 2)  # PRV upper bound
        1.84

    Args:
        accountant: Default accountant, ``"prv"`` (Gopi et al. 2021) or ``"rdp"`` (Mironov 2017).
        eps_error: PRV accuracy: the PRV upper and lower bounds are ~``eps_error`` from the estimate.
        delta_error: PRV δ accuracy. ``None``: ``delta / 1000`` for each query (as ``prv_accountant.Accountant``
            does), and 1e-10 for :meth:`get_delta`.

    Raises:
        ValueError: For an unknown accountant or non-positive errors.
    """

    planned_steps: int | None = None
    """Optional hint: the run's total number of steps. With a single (σ, q) mechanism, ε at every intermediate step
    is then read off one PRV discretisation sized for the whole run (cheap logging); it does not change the bound's
    guarantee."""

    def __init__(self, accountant: str = "prv", eps_error: float = 0.01, delta_error: float | None = None) -> None:
        self.accountant: str = _check_accountant(accountant)
        self.eps_error: float = _check_eps_error(eps_error)
        self.delta_error: float | None = None if delta_error is None else _check_delta(delta_error, "delta_error")
        self.history: list[MechanismRecord] = []
        self.accountant_used: str | None = None
        """The accountant that produced the last :meth:`get_epsilon` / :meth:`get_delta` result: ``"prv"``,
        ``"pld (prv-accountant failed numerically)"``, ``"rdp"`` or ``"rdp (prv-accountant and pld failed
        numerically)"`` (None before the first query)."""

    def use(self, accountant: str, eps_error: float) -> None:
        """Compute ε of the whole history with ``accountant`` at ``eps_error`` from now on (the arguments of a later
        ``train()`` name another one: the record then names the accountant that computes its ε)."""
        self.accountant, self.eps_error = _check_accountant(accountant), _check_eps_error(eps_error)

    def __repr__(self) -> str:
        return (f"PrivacyAccountant(accountant={self.accountant!r}, eps_error={self.eps_error}, "
                f"delta_error={self.delta_error}, steps={self.steps}, records={len(self.history)})")

    # ------------------------------------------------------------------ recording
    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Records ``num_steps`` DP-SGD steps with noise multiplier σ and Poisson sampling rate q.

        Args:
            noise_multiplier: σ >= 0 (σ = 0 means no privacy: ε becomes infinite).
            sample_rate: q in (0, 1].
            num_steps: Number of steps, >= 0 (0 records nothing).

        Raises:
            ValueError: If an argument is out of range.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_steps(num_steps)
        if n == 0:
            return
        if self.history and self.history[-1].noise_multiplier == sigma and self.history[-1].sample_rate == q:
            self.history[-1] = MechanismRecord(sigma, q, self.history[-1].steps + n)
        else:
            self.history.append(MechanismRecord(sigma, q, n))

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(r.steps for r in self.history)

    def _mechanisms(self) -> _Mechanisms:
        return _aggregate((r.noise_multiplier, r.sample_rate, r.steps) for r in self.history)

    def _delta_error_for(self, delta: float) -> float:
        delta_error = self.delta_error if self.delta_error is not None else delta / 1000
        if delta_error >= delta:
            raise ValueError(f"delta_error ({delta_error}) must be smaller than delta ({delta}).")
        return delta_error

    # ------------------------------------------------------------------ queries
    def get_epsilon(self, delta: float, accountant: str | None = None) -> float:
        """ε spent so far at ``delta``: a conservative upper bound.

        Args:
            delta: Target δ in (0, 1).
            accountant: ``"prv"`` (upper bound of the PRV accountant) or ``"rdp"``; ``None``: the default.

        Returns:
            ε (0.0 for an empty history, ``math.inf`` if any step had σ = 0). With ``"prv"``, where
            ``prv_accountant`` fails numerically, ε is the pessimistic PLD upper bound of ``dp_accounting`` (RDP only
            if that fails too, with a ``RuntimeWarning``); :attr:`accountant_used` says which.

        Raises:
            ValueError: For an invalid δ or accountant.
        """
        acc = _check_accountant(self.accountant if accountant is None else accountant)
        delta = _check_delta(delta)
        mechs = self._mechanisms()
        if not mechs:
            self.accountant_used = acc
            return 0.0
        if any(sigma == 0 for sigma, _, _ in mechs):
            self.accountant_used = acc
            return math.inf
        if acc == "rdp":
            self.accountant_used = RDP_NAME
            return _rdp_epsilon(mechs, delta)
        delta_error = self._delta_error_for(delta)
        planned_prv = None
        planned = self.planned_steps
        if len(mechs) == 1 and planned is not None and mechs[0][2] <= planned:
            # One PRV discretisation sized for the whole planned run answers every intermediate step: the
            # composition for n <= planned steps keeps the same error guarantee (Gopi et al. 2021), at a
            # fraction of the cost of a new discretisation per logging step.
            sigma, q, n = mechs[0]

            def planned_prv() -> float:
                try:
                    return _planned_prv_epsilon(sigma, q, planned, n, delta, self.eps_error, delta_error)
                except _PRVNumericalError:
                    return _prv_epsilon_bounds(mechs, delta, self.eps_error, delta_error)[2]

        eps, self.accountant_used = _tight_epsilon(mechs, delta, self.eps_error, delta_error, planned_prv)
        return eps

    def get_epsilon_bounds(self, delta: float) -> tuple[float, float, float]:
        """PRV (lower bound, estimate, upper bound) of ε at ``delta``; the bounds are ~``eps_error`` apart.

        Values are clipped at 0.

        Args:
            delta: Target δ in (0, 1).

        Returns:
            ``(lower, estimate, upper)``; zeros for an empty history, infinities if any step had σ = 0.

        Raises:
            ValueError: For an invalid δ, or if the PRV accountant cannot compute this composition.
        """
        delta = _check_delta(delta)
        mechs = self._mechanisms()
        if not mechs:
            return (0.0, 0.0, 0.0)
        if any(sigma == 0 for sigma, _, _ in mechs):
            return (math.inf, math.inf, math.inf)
        try:
            return _prv_epsilon_bounds(mechs, delta, self.eps_error, self._delta_error_for(delta))
        except _PRVNumericalError as err:
            raise ValueError(f"PRV accounting failed: {err}") from err

    def get_delta(self, epsilon: float) -> float:
        """PRV upper bound on δ at ``epsilon`` (the PLD bound if the PRV computation fails, RDP if both fail).

        Args:
            epsilon: ε >= 0.

        Returns:
            δ in [0, 1] (0.0 for an empty history, 1.0 if any step had σ = 0).

        Raises:
            ValueError: For a negative or non-finite ε.
        """
        eps = float(epsilon)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}.")
        mechs = self._mechanisms()
        if not mechs:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in mechs):
            return 1.0
        delta_error = self.delta_error if self.delta_error is not None else _GET_DELTA_DEFAULT_DELTA_ERROR
        try:
            self.accountant_used = PRV
            return _prv_delta_bounds(mechs, eps, self.eps_error, delta_error)[2]
        except _PRVNumericalError as err:
            try:
                self.accountant_used = PLD_FALLBACK
                return _pld_delta(mechs, eps, pld_discretization(self.eps_error))
            except _PRVNumericalError as pld_err:
                warnings.warn(f"PRV accounting failed ({err}) and so did the PLD accountant ({pld_err}); reporting "
                              "the (looser) RDP upper bound instead.", RuntimeWarning, stacklevel=2)
                self.accountant_used = RDP_FALLBACK
                return _rdp_delta(mechs, eps)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: settings, history and the prv-accountant version it was computed with."""
        return {
            "version": STATE_DICT_VERSION,
            "accountant": self.accountant,
            "eps_error": self.eps_error,
            "delta_error": self.delta_error,
            "history": [asdict(r) for r in self.history],
            "prv_accountant_version": _prv_accountant_version(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (validating it; the current object is unchanged on error).

        Args:
            state: A dict produced by :meth:`state_dict` (possibly after a JSON round trip).

        Raises:
            ValueError: If the state is malformed.
        """
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError("Not a PrivacyAccountant state dict (no 'history').")
        try:
            history = [MechanismRecord(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in state["history"]]
        except (KeyError, TypeError) as err:
            raise ValueError(f"Malformed history in PrivacyAccountant state dict: {err!r}") from err
        accountant = _check_accountant(state.get("accountant", self.accountant))
        eps_error = _check_eps_error(state.get("eps_error", self.eps_error))
        delta_error = state.get("delta_error", self.delta_error)
        delta_error = None if delta_error is None else _check_delta(delta_error, "delta_error")
        saved_version = state.get("prv_accountant_version")
        if saved_version is not None and saved_version != _prv_accountant_version():
            warnings.warn(f"Accountant state was saved with prv-accountant {saved_version}, running "
                          f"{_prv_accountant_version()}: epsilon may differ slightly.", UserWarning, stacklevel=2)
        self.accountant, self.eps_error, self.delta_error, self.history = accountant, eps_error, delta_error, history

    def copy(self) -> PrivacyAccountant:
        """An independent copy (settings and history; the result cache is shared, which is safe)."""
        new = PrivacyAccountant(self.accountant, self.eps_error, self.delta_error)
        new.history = [_copy.copy(r) for r in self.history]
        new.planned_steps = self.planned_steps
        new.accountant_used = self.accountant_used
        return new


# ------------------------------------------------------------------------------------------------- calibration
def calibrate_noise_multiplier(target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                               accountant: str = "prv", eps_error: float = 0.01, tolerance: float = 0.01,
                               history: list[MechanismRecord] | None = None,
                               delta_error: float | None = None) -> float:
    """Smallest σ such that ε after ``steps`` more steps at rate q is <= ``target_epsilon``.

    The steps are composed after the optional existing ``history`` (e.g. when resuming). The returned σ is
    verified with the requested accountant and ``eps_error`` (for PRV: the upper bound, as reported by
    :meth:`PrivacyAccountant.get_epsilon`, i.e. the pessimistic PLD bound where ``prv_accountant`` fails
    numerically), so it never overshoots the target, and ``σ * (1 - tolerance)`` was
    verified to miss it. The search first brackets σ in log-space (doubling/halving) and locates the root with
    Brent's method on log σ (bisection safeguarded by secant steps) using a cheap coarse PRV (``eps_error >= 0.1``,
    aiming its estimate at ``target - eps_error``); it then bisects in log-space with the exact setting, usually
    needing only two full-precision evaluations (~1-3 s in total for T=1000, q=0.01, ε in [1, 8]).

    Args:
        target_epsilon: Target ε > 0.
        target_delta: Target δ in (0, 1).
        sample_rate: Poisson sampling rate q in (0, 1].
        steps: Number of future steps, >= 1.
        accountant: ``"prv"`` or ``"rdp"``.
        eps_error: PRV ``eps_error`` used for the final verification.
        tolerance: Relative tolerance on σ, in (0, 0.5].
        history: Steps already taken (their privacy cost counts towards the target).
        delta_error: PRV ``delta_error``; ``None``: ``target_delta / 1000``.

    Returns:
        The noise multiplier σ.

    Raises:
        ValueError: For invalid arguments, or if the target is unreachable (the history alone, or the PRV
            resolution ``eps_error``, already exceeds it), or if even σ = 0.01 meets it.
    """
    if not (math.isfinite(float(target_epsilon)) and float(target_epsilon) > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
    target = float(target_epsilon)
    delta = _check_delta(target_delta, "target_delta")
    q = _check_sample_rate(sample_rate)
    n_steps = _check_steps(steps, "steps", minimum=1)
    acc = _check_accountant(accountant)
    eps_error = _check_eps_error(eps_error)
    tol = float(tolerance)
    if not (0.0 < tol <= 0.5):
        raise ValueError(f"tolerance must be in (0, 0.5], got {tolerance!r}.")
    if delta_error is None:
        delta_error = delta / 1000
    delta_error = _check_delta(delta_error, "delta_error")
    if delta_error >= delta:
        raise ValueError(f"delta_error ({delta_error}) must be smaller than target_delta ({delta}).")
    past = [(r.noise_multiplier, r.sample_rate, r.steps) for r in (history or [])]
    if any(sigma == 0 and n > 0 for sigma, _, n in past):
        raise ValueError("target_epsilon is unreachable: the history contains a step with noise_multiplier=0 "
                         "(epsilon is already infinite).")
    if acc == "prv" and target <= eps_error:
        raise ValueError(f"target_epsilon={target} is unreachable with the PRV upper bound at eps_error={eps_error} "
                         "(the bound includes +eps_error); use a smaller eps_error "
                         "(DPTrainingArguments.accountant_eps_error).")

    # The discretised estimate is far more accurate than the bounds' width, so the bracketing can use a coarse mesh.
    coarse_eps_error = max(eps_error, _COARSE_EPS_ERROR, 0.02 * target)

    def epsilon(sigma: float, fine: bool) -> float:
        mechs = _aggregate([*past, (sigma, q, n_steps)])
        if acc == "rdp":
            return _rdp_epsilon(mechs, delta)
        if fine:
            return _tight_epsilon(mechs, delta, eps_error, delta_error)[0]
        try:
            return _prv_epsilon_bounds(mechs, delta, coarse_eps_error, delta_error, _COARSE_MAX_DOMAIN_POINTS)[1]
        except _PRVNumericalError:
            # prv_accountant fails for small σ at large q: the (pessimistic) PLD on a coarse grid, else RDP.
            try:
                return _pld_epsilon(mechs, delta, pld_discretization(coarse_eps_error))
            except _PRVNumericalError:
                return _rdp_epsilon(mechs, delta)

    def history_epsilon() -> float:
        mechs = _aggregate(past)
        if not mechs:
            return 0.0
        if acc == "prv":
            return _tight_epsilon(mechs, delta, eps_error, delta_error)[0]
        return _rdp_epsilon(mechs, delta)

    def unreachable() -> ValueError:
        msg = (f"target_epsilon={target} at delta={delta} is unreachable: even noise_multiplier={_SIGMA_MAX:g} for "
               f"{n_steps} steps at sample_rate={q} gives epsilon={epsilon(_SIGMA_MAX, True):.4g}")
        if past:
            msg += f" (the existing history alone spends epsilon={history_epsilon():.4g})"
        return ValueError(msg + ".")

    if past and (eps_past := history_epsilon()) >= target:
        raise ValueError(f"target_epsilon={target} at delta={delta} is unreachable: the existing history alone "
                         f"already spends epsilon={eps_past:.4g} ({acc} accountant).")

    def too_small() -> ValueError:
        return ValueError(f"target_epsilon={target} at delta={delta} is met even with noise_multiplier={_SIGMA_MIN:g} "
                          f"({n_steps} steps at sample_rate={q}); calibration is not meaningful.")

    # Phase 1: bracket in log-space (doubling/halving σ), then locate the root of a cheap criterion with Brent's
    # method on log σ (bisection safeguarded by secant steps). For PRV the criterion is the coarse estimate vs
    # target - eps_error (the fine upper bound is ~ estimate + eps_error); for RDP it is already the exact one.
    coarse_target = target if acc == "rdp" else target - eps_error

    def excess(s: float) -> float:
        return epsilon(s, acc == "rdp") - coarse_target

    lo, hi = 0.5, 1.0
    if excess(hi) <= 0:
        while excess(lo) <= 0:
            if lo <= _SIGMA_MIN:
                if epsilon(lo, True) <= target:
                    raise too_small()
                break
            lo, hi = max(lo / 2, _SIGMA_MIN), lo
    else:
        lo, hi = 1.0, 2.0
        while excess(hi) > 0:
            if hi >= _SIGMA_MAX:
                if epsilon(hi, True) > target:
                    raise unreachable()
                break
            lo, hi = hi, min(hi * 2, _SIGMA_MAX)
    max_ratio = 1 / (1 - tol)
    if excess(lo) > 0 >= excess(hi):
        root = math.exp(optimize.brentq(lambda x: excess(math.exp(x)), math.log(lo), math.log(hi),
                                        xtol=tol / 8, rtol=4 * np.finfo(float).eps))
    else:  # clamped at the end of the search range
        root = hi if excess(hi) > 0 else lo

    # Phase 2: exact (fine) criterion around the coarse root: hi must meet the target, lo = hi * (1 - tol) must not.
    def ok(s: float) -> bool:
        return epsilon(s, True) <= target

    hi = root * math.sqrt(max_ratio)
    lo = hi * (1 - tol)
    factor = max_ratio
    if not ok(hi):
        while True:
            if hi >= _SIGMA_MAX:
                raise unreachable()
            lo, hi = hi, min(hi * factor, _SIGMA_MAX)
            factor *= factor
            if ok(hi):
                break
    else:
        while ok(lo):
            if lo <= _SIGMA_MIN:
                raise too_small()
            lo, hi = max(lo / factor, _SIGMA_MIN), lo
            factor *= factor
    while lo < hi * (1 - tol) * (1 - 1e-12):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return float(hi)


# ------------------------------------------------------------------------------------------------ group privacy
def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """Converts (ε, δ)-DP for single records into a guarantee for groups of ``group_size`` records.

    Standard group privacy (see e.g. Vadhan 2017, "The Complexity of Differential Privacy"; Dwork & Roth 2014 for
    the pure-DP case): an (ε, δ)-DP mechanism is ``(k ε, k e^{(k-1) ε} δ)``-DP for datasets differing in ``k``
    records, by chaining the guarantee along k neighbouring datasets. Privacy *degrades* with the group size:
    dividing ε by the group size (the ε/γ of Kerrigan et al. 2020, "Differentially Private Language Models Benefit
    from Public Pre-training") is **not** a valid bound.

    Args:
        epsilon: Record-level ε >= 0.
        delta: Record-level δ in [0, 1].
        group_size: k >= 1.

    Returns:
        ``(k * epsilon, min(1, k * exp((k - 1) * epsilon) * delta))``.

    Raises:
        ValueError: For out-of-range arguments.
    """
    eps = float(epsilon)
    d = float(delta)
    k = _check_steps(group_size, "group_size", minimum=1)
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}.")
    if not (0.0 <= d <= 1.0):
        raise ValueError(f"delta must be in [0, 1], got {delta!r}.")
    if k == 1:
        return eps, d
    if d == 0.0:
        return k * eps, 0.0
    log_group_delta = math.log(k) + (k - 1) * eps + math.log(d)  # log space: no overflow, never under-estimated
    group_delta = 1.0 if log_group_delta >= 0 else math.exp(log_group_delta)
    return k * eps, group_delta


def split_noise_for_quantiles(noise_multiplier: float, num_groups: int, budget_fraction: float | None = None,
                              quantile_noise_multiplier: float | None = None) -> tuple[float, float]:
    """Noise multipliers of adaptive clipping's two releases, so that together they cost what ``σ`` alone does.

    He et al. 2023, Prop. 3.1 (App. D): releasing the clipped gradient sum (sensitivity S, noise ``σ_new S``) and
    ``K`` symmetrised clip counts (sensitivity ½ each, noise ``σ_b``) together is a Gaussian mechanism with noise
    multiplier ``σ`` when ``σ⁻² = σ_new⁻² + K / (2 σ_b)²``. Given the budget fraction ``r`` for the counts,
    ``σ_b = σ √K / (2 √r)`` and ``σ_new = σ / √(1 − r)``. The accountant records ``σ``.

    Args:
        noise_multiplier: ``σ`` (what the accountant records); 0 gives ``(0, 0)`` (testing only).
        num_groups: ``K``.
        budget_fraction: ``r`` in (0, 1).
        quantile_noise_multiplier: ``σ_b`` instead of ``r``.

    Returns:
        ``(σ_new, σ_b)``.

    Raises:
        ValueError: if ``σ_new`` would not be real (``σ_b ≤ σ √K / 2``) or ``r`` is not in (0, 1).
    """
    if (budget_fraction is None) == (quantile_noise_multiplier is None):
        raise ValueError("Give exactly one of budget_fraction (r) and quantile_noise_multiplier (σ_b).")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}.")
    if noise_multiplier == 0:
        return 0.0, 0.0
    if budget_fraction is not None:
        if not 0 < budget_fraction < 1:
            raise ValueError(f"The quantile budget fraction r must be in (0, 1), got {budget_fraction}.")
        sigma_b = noise_multiplier * math.sqrt(num_groups) / (2 * math.sqrt(budget_fraction))
    else:
        sigma_b = float(quantile_noise_multiplier)
    remaining = noise_multiplier**-2 - num_groups / (2 * sigma_b) ** 2 if sigma_b > 0 else -1.0
    if not remaining > 0:
        raise ValueError(
            f"σ_new = (σ⁻² − K/(2σ_b)²)^(-1/2) is not real for σ={noise_multiplier:.4g}, K={num_groups}, "
            f"σ_b={sigma_b:.4g}: the {num_groups} quantile releases alone would cost more than the whole budget. "
            f"Use σ_b > {noise_multiplier * math.sqrt(num_groups) / 2:.4g} (a smaller quantile budget fraction), "
            "fewer groups, or more noise (a smaller target ε)."
        )
    return remaining**-0.5, sigma_b
