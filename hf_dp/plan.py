"""The privacy plan of a run, before any data is loaded: σ, steps, q, ε, δ and the noise-to-signal ratios.

One function, :func:`plan_privacy`, computes the plan from the Trainer's own argument names (``num_examples``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``num_train_epochs`` / ``max_steps``,
``target_epsilon`` / ``noise_multiplier``, ``target_delta``, ``trainable_parameters``, ``world_size``, ...).
``DPTrainer.privacy_plan()`` calls it with the trainer's values and ``hf-dp plan`` / ``python -m hf_dp plan``
(``hf_dp/__main__.py``) with the command line's; ``DPTrainer`` calibrates σ at train start with
:func:`calibrate_noise`, the one calibration in the codebase, and reads q, the expected batch, the steps per epoch, the
default δ and the noise-to-signal ratios from the functions here.

The quantities (Abadi et al. 2016; Li et al. 2022 §3.1 for the effective noise σ/q):

* expected batch ``B = per_device_train_batch_size × gradient_accumulation_steps × world_size`` (privacy units);
* sampling rate ``q = B / N`` (Poisson sampling of the N privacy units);
* steps per epoch ``⌈N / B⌉``; steps ``max_steps`` if > 0, else ``⌈num_train_epochs × steps per epoch⌉`` (the
  rule of ``Trainer.set_initial_training_values``, applied to the DP loader's length);
* δ: ``target_delta`` or ``1 / N^1.1`` (below 1/N);
* σ: ``noise_multiplier``, or the smallest σ whose ε after the planned steps is at most ``target_epsilon``;
* ``noise_to_signal = σ·C·√d / (q·N) / C``: the expected norm of the noise on one averaged update over the largest
  possible norm of the averaged clipped gradient; ``noise_to_signal_over_run`` = that / √T for the sum of T updates.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from .accounting import MechanismRecord, PrivacyAccountant, calibrate_noise_multiplier
from .guarantee import check_delta, check_noise_std

__all__ = [
    "NOISE_TO_SIGNAL_WARNING",
    "calibrate_noise",
    "default_delta",
    "epsilon_after",
    "expected_batch_size",
    "learning_advice",
    "noise_to_signal",
    "noise_to_signal_report",
    "plan_privacy",
    "planned_steps",
    "sample_rate",
    "steps_per_epoch",
]

NOISE_TO_SIGNAL_WARNING = 1.0
"""hf_dp warns that the noise dominates when the noise-to-signal ratio of the whole run, σ·√d / (q·N·√T) (the
expected noise norm of T averaged updates summed, ``√T·σ·C·√d/(q·N)``, over the largest possible sum of their signals,
``T·C``), exceeds this: then even gradients that all point the same way in every step are smaller, in norm, than the
noise. It is a warning, not a prediction: the ratio spreads the noise over all d coordinates, while the gradients of a
pretrained model concentrate in a few directions, along which the noise is far smaller (Li et al. 2022b, "When Does
Differentially Private Learning Not Suffer in High Dimensions?", NeurIPS 2022). Measured here: the whole MiniLM-L6
(22.6 M parameters) on 4,000 reviews learned at ratios 1.22 and 2.04 (79.9 / 77.0 % against 83.0 % non-private and a
65.8 % majority class), while at N = 500 runs at 4.2 and 10.7 — and LoRA at 0.44 — stayed at the majority class
(benchmarks/RESULTS.md, examples/README.md). Li et al. 2022's full fine-tuning runs that learn well are at ≈ 0.4-0.6
(GPT-2 on E2E at ε = 3: σ ≈ 1.02, q = 0.024, 411 steps, 124 M parameters; RoBERTa-base on SST-2 at ε = 3-8)
(README, "Choosing hyperparameters")."""


def expected_batch_size(per_device_train_batch_size: int, gradient_accumulation_steps: int, world_size: int) -> int:
    """The expected logical batch (privacy units per step): per-device batch × accumulation × processes."""
    return int(per_device_train_batch_size) * int(gradient_accumulation_steps) * int(world_size)


def sample_rate(expected_batch: int, num_examples: int, user_level: bool = False) -> float:
    """q = expected batch size / N (N counts privacy units); refuses q > 1."""
    q = expected_batch / num_examples
    if q > 1:
        unit = "users" if user_level else "training set size"
        raise ValueError(
            f"The expected batch size {expected_batch} exceeds the {unit} {num_examples} (q = {q:.3f} > 1). Lower "
            "per_device_train_batch_size or gradient_accumulation_steps."
        )
    return q


def default_delta(num_examples: int) -> float:
    """The default δ, ``1 / N^1.1`` (below 1/N)."""
    return 1.0 / num_examples**1.1


def steps_per_epoch(num_examples: int, expected_batch: int) -> int:
    """Logical steps per epoch: ``ceil(N / expected batch size)`` (= ceil(1/q))."""
    return math.ceil(num_examples / expected_batch)


def planned_steps(per_epoch: int, max_steps: int = -1, num_train_epochs: float = 3.0) -> int:
    """The optimizer steps the Trainer runs: ``max_steps`` if > 0, else ``ceil(num_train_epochs × steps per epoch)``
    (``Trainer.set_initial_training_values`` on a loader of ``per_epoch × gradient_accumulation_steps`` chunks)."""
    if max_steps is not None and max_steps > 0:
        return int(max_steps)
    return math.ceil(num_train_epochs * max(int(per_epoch), 1))


def noise_to_signal(noise_multiplier: float, trainable_parameters: int, expected_batch: float,
                    steps: int = 1) -> tuple[float, float]:
    """``(σ·√d / (q·N), σ·√d / (q·N·√T))``: the expected norm of the noise on one averaged update (``σ·C·√d/(q·N)``)
    over the largest possible norm of the averaged clipped gradient (``C``), and the same for the sum of the run's T
    updates (noise grows as √T, the signal at most as T). C cancels. ``expected_batch`` is q·N."""
    ratio = float(noise_multiplier) * math.sqrt(trainable_parameters) / expected_batch
    return ratio, ratio / math.sqrt(max(int(steps), 1))


def noise_to_signal_report(noise_multiplier: float, trainable_parameters: int, expected_batch: float, steps: int,
                           batch: int) -> dict[str, Any]:
    """The noise-to-signal part of a plan (:func:`noise_to_signal`), and the advice when the noise dominates (the run's
    ratio above :data:`NOISE_TO_SIGNAL_WARNING`): what :func:`plan_privacy` returns and the train-start banner logs.
    ``noise_dominates`` says so; ``learning_unlikely`` is the same flag under its first name (kept for callers that
    read it; the ratio does not predict learning, see :data:`NOISE_TO_SIGNAL_WARNING`). ``expected_batch`` is q·N,
    ``batch`` the integer expected batch the advice names."""
    ratio, run_ratio = noise_to_signal(noise_multiplier, trainable_parameters, expected_batch, steps)
    dominates = run_ratio > NOISE_TO_SIGNAL_WARNING
    return {"noise_to_signal": ratio, "noise_to_signal_over_run": run_ratio, "noise_dominates": dominates,
            "learning_unlikely": dominates,
            "advice": learning_advice(ratio, run_ratio, trainable_parameters, float(noise_multiplier), batch, steps)
            if dominates else None}


def epsilon_after(accountant: PrivacyAccountant, noise_multiplier: float, rate: float, steps: int, delta: float
                  ) -> tuple[float, PrivacyAccountant]:
    """ε at δ after ``steps`` more steps at (σ, q) composed after what ``accountant`` holds, on a copy sized for
    exactly those steps, as the calibration (:func:`calibrate_noise`) computes it; and that copy (its
    ``accountant_used`` names the accountant that produced ε). The plan, the banner and the budget all read ε here."""
    acc = accountant.copy()
    acc.planned_steps = None  # the same computation as the calibration
    acc.step(noise_multiplier, rate, steps)
    return float(acc.get_epsilon(delta)), acc


def learning_advice(ratio: float, run_ratio: float, d: int, sigma: float, batch: int, steps: int) -> str:
    """What the plan, ``hf-dp plan`` and the train-start banner say when the noise dominates."""
    return (
        f"hf_dp: the noise dominates: the noise on each averaged update has expected norm σ·C·√d/(q·N) = {ratio:.3g}"
        f" × C ({d:,} trainable parameters, σ={sigma:.3g}, expected batch {batch}); over the run's {steps} steps it "
        f"is {run_ratio:.3g} times the largest possible signal (above {NOISE_TO_SIGNAL_WARNING:g}). A pretrained "
        "model can still learn there (its gradients concentrate in a few directions: Li et al. 2022b), but runs "
        "like this often stay at the majority class. To lower it: train fewer parameters (the head on frozen "
        "features, the top layers, or LoRA: peft_config=...), use a larger expected batch "
        "(gradient_accumulation_steps), more data, or a larger ε. See the README, 'Choosing hyperparameters' "
        "(Li et al. 2022 §3; benchmarks/RESULTS.md; examples/dp_strategies.py)."
    )


def calibrate_noise(target_epsilon: float, delta: float, rate: float, steps: int, accountant: str = "prv",
                    eps_error: float = 0.01, history: Sequence[MechanismRecord] = ()) -> float:
    """σ meeting ``target_epsilon`` at δ after ``steps`` more steps at rate q, composed after ``history``: the one
    calibration that ``DPTrainer.train()`` (at train start), ``DPTrainer.privacy_plan()`` and ``hf-dp plan`` use
    (:func:`~hf_dp.accounting.calibrate_noise_multiplier`)."""
    return calibrate_noise_multiplier(target_epsilon, delta, rate, max(int(steps), 1), accountant=accountant,
                                      eps_error=eps_error, history=list(history))


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def plan_privacy(*, num_examples: int, per_device_train_batch_size: int = 8, gradient_accumulation_steps: int = 1,
                 world_size: int = 1, num_train_epochs: float = 3.0, max_steps: int = -1, steps: int | None = None,
                 target_epsilon: float | None = None, noise_multiplier: float | None = None,
                 target_delta: float | None = None, trainable_parameters: int | None = None,
                 per_sample_max_grad_norm: float = 0.1, accountant: str = "prv", accountant_eps_error: float = 0.01,
                 clipping: str = "flat", privacy_unit: str = "example", poisson_sampling: bool = True,
                 history: Sequence[MechanismRecord] = ()) -> dict[str, Any]:
    """The privacy plan of a run: what ``DPTrainer.privacy_plan()`` returns, from the Trainer's argument names.

    σ is ``noise_multiplier`` (``epsilon`` is then what the whole run spends) or calibrated to ``target_epsilon``
    (:func:`calibrate_noise`) for the planned steps. ε is the configured accountant's upper bound (PRV by default,
    PLD where prv-accountant fails numerically: ``accountant_used``) for exactly those steps.

    Args:
        num_examples: N, the number of privacy units (examples; users with ``privacy_unit="user"``).
        per_device_train_batch_size, gradient_accumulation_steps, world_size: the expected batch is their product.
        num_train_epochs, max_steps: as in ``TrainingArguments`` (``max_steps > 0`` wins).
        steps: the planned steps directly (``DPTrainer`` passes the Trainer's own count); overrides the two above.
        target_epsilon, noise_multiplier: exactly one of them.
        target_delta: δ; default ``1/N^1.1``. Must be below 1/N.
        trainable_parameters: d, for the noise-to-signal ratios (``None`` leaves them out).
        per_sample_max_grad_norm, accountant, accountant_eps_error, clipping, privacy_unit, poisson_sampling:
            as in ``DPTrainingArguments`` (C only scales the noise std σ·C; the ratios do not depend on it).
        history: the mechanisms of earlier DP runs of the same model (a model carries its privacy history,
            ``hf_dp/history.py``): σ is calibrated after them and ``epsilon`` composes them with the planned steps.

    Returns:
        A JSON-safe dict: ``noise_multiplier``, ``sample_rate``, ``steps``, ``epsilon``, ``delta``,
        ``expected_batch_size``, ``noise_to_signal``, ``noise_to_signal_over_run``, ``noise_dominates``,
        ``learning_unlikely`` (the same flag),
        ``advice`` and the inputs they come from.
    """
    n = _check_positive_int("num_examples", num_examples)
    batch = expected_batch_size(_check_positive_int("per_device_train_batch_size", per_device_train_batch_size),
                                _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps),
                                _check_positive_int("world_size", world_size))
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError(
            "Give exactly one of target_epsilon (σ is calibrated to it) and noise_multiplier (ε is reported); got "
            f"target_epsilon={target_epsilon}, noise_multiplier={noise_multiplier}."
        )
    if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}.")
    if not (math.isfinite(per_sample_max_grad_norm) and per_sample_max_grad_norm > 0):
        raise ValueError(f"per_sample_max_grad_norm (C) must be a finite number > 0, got {per_sample_max_grad_norm}.")
    if trainable_parameters is not None:
        trainable_parameters = _check_positive_int("trainable_parameters", trainable_parameters, minimum=0)
    if privacy_unit not in ("example", "user"):
        raise ValueError(f"privacy_unit must be 'example' or 'user', got {privacy_unit!r}.")
    user_level = privacy_unit == "user"
    q = sample_rate(batch, n, user_level)
    per_epoch = steps_per_epoch(n, batch)
    if steps is None:
        if (max_steps is None or max_steps <= 0) and not (math.isfinite(num_train_epochs) and num_train_epochs > 0):
            raise ValueError(f"num_train_epochs must be > 0 (or max_steps > 0), got {num_train_epochs}.")
        steps = planned_steps(per_epoch, max_steps, num_train_epochs)
    steps = int(steps)
    delta = default_delta(n) if target_delta is None else float(target_delta)
    if not 0 < delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta}.")
    check_delta(delta, n)
    calibrated = noise_multiplier is None
    history = list(history)
    sigma = (calibrate_noise(target_epsilon, delta, q, steps, accountant, accountant_eps_error, history) if calibrated
             else float(noise_multiplier))
    check_noise_std(sigma, per_sample_max_grad_norm)
    fresh = PrivacyAccountant(accountant=accountant, eps_error=accountant_eps_error)
    fresh.history = history
    epsilon, acc = epsilon_after(fresh, sigma, q, steps, delta)
    plan: dict[str, Any] = {
        "target_epsilon": target_epsilon,
        "epsilon": epsilon,
        "delta": delta,
        "noise_multiplier": sigma,
        "noise_multiplier_calibrated": calibrated,
        "sample_rate": q,
        "expected_batch_size": batch,
        "num_examples": n,
        "steps": steps,
        "earlier_steps": sum(int(m.steps) for m in history),
        "epochs": steps / per_epoch,
        "per_sample_max_grad_norm": float(per_sample_max_grad_norm),
        "clipping": str(clipping),
        "privacy_unit": privacy_unit,
        "accountant": str(accountant),
        "accountant_used": acc.accountant_used,
        "accountant_eps_error": acc.eps_error,
        "poisson_sampling": bool(poisson_sampling),
        "trainable_parameters": trainable_parameters,
        "noise_to_signal": None,
        "noise_to_signal_over_run": None,
        "noise_dominates": None,
        "learning_unlikely": None,
        "advice": None,
    }
    if trainable_parameters is not None:
        plan.update(noise_to_signal_report(sigma, trainable_parameters, q * n, steps, batch))
    return plan
