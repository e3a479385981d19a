"""The DP mechanism of a run, as one object: σ, q, the expected batch, N, δ, the accountant, the noise, the budget.

One DP-SGD step (Abadi et al. 2016, Alg. 1) releases ``(Σ_i clip(g_i) + N(0, σ²S²)) / (q·N)`` for a Poisson sample
of rate ``q = B/N`` (``B`` the expected batch, ``N`` the privacy units), and the accountant records ``(σ, q)``.
:class:`Mechanism` holds those quantities for :class:`~hf_dp.DPTrainer`, which owns one. The DP step
(``clipping/step.py``) reads it at every release (noise stds, the step's generator, the accountant, the budget),
the privacy plan and the train-start banner read it (:func:`hf_dp.plan.plan_privacy` and
:meth:`Mechanism.plan_log`, both from the one set of plan functions in ``plan.py``), and so does the record
(``DPTrainer.privacy_record``). It never sees the trainer: the training set is read through a callable (the user may
assign ``trainer.train_dataset``), the clipping groups and parameters are handed to it when the clipping machinery is
built (:meth:`set_clipping`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from .accounting import MechanismRecord, PrivacyAccountant, split_noise_for_quantiles
from .guarantee import (
    budget_allows,
    check_budget_left,
    check_delta,
    check_noise_std,
    check_step_mechanism,
    steps_within_budget,
)
from .noise import NoiseGenerator, group_noise_stds
from .plan import (
    calibrate_noise,
    default_delta,
    epsilon_after,
    expected_batch_size,
    noise_to_signal_report,
    plan_privacy,
    sample_rate,
    steps_per_epoch,
)
from .record import plain
from .sampling import PoissonBatchSampler, PoissonUserSampler, ShuffledBatchSampler

__all__ = ["FIXED_DURING_RUN", "FIXED_UNDER_GROUP_CLIPPING", "Mechanism"]

logger = logging.getLogger(__name__)

#: ``DPTrainingArguments`` fields the mechanism is set up from when ``train()`` begins and does not follow during it:
#: the accountant (built with the trainer), the sampler and its seed (built with the train loader), the noise source,
#: the clipping mode and its groups / quantiles, the noise allocation, the privacy unit. The record and the card read
#: them from the arguments, so a change during ``train()`` would describe a mechanism that did not run
#: (:meth:`Mechanism.check_fixed_arguments`). ``noise_multiplier``, ``target_epsilon`` and ``target_delta`` are
#: followed (:meth:`Mechanism.follow_sigma`, :meth:`Mechanism.follow_target`); q's inputs and C inside a step are
#: checked by ``guarantee.check_step_mechanism``.
FIXED_DURING_RUN = ("accountant", "accountant_eps_error", "poisson_sampling", "dp_seed", "secure_mode", "clipping",
                    "clipping_groups", "group_max_grad_norms", "noise_allocation", "target_quantile", "quantile_lr",
                    "adaptive_rescale_to_global", "privacy_unit", "user_id_column", "max_examples_per_user",
                    "user_contribution")
#: with group-wise clipping, the thresholds and the clipping function are the group clipper's, built at set-up (flat
#: clipping reads C and the clipping function at every chunk: a change between steps is followed)
FIXED_UNDER_GROUP_CLIPPING = ("per_sample_max_grad_norm", "clipping_function", "automatic_clipping_gamma")


class Mechanism:
    """σ, q, the expected batch, N, δ, the one accountant, the one noise source and the budget of a DP run.

    Args:
        args: the run's ``DPTrainingArguments`` (read live: a hyperparameter search edits them in place).
        dataset: returns the current training set (``None`` before one is given).
        current_args: returns the arguments object the Trainer reads now (``trainer.args``); checked to be ``args``
            at train start and at every step (:meth:`check_arguments_object`).

    Attributes:
        accountant: the model's :class:`~hf_dp.PrivacyAccountant` (replaced on resume and for a new model).
        noise_multiplier: σ (``None`` until calibrated to ``target_epsilon`` at train start).
        noise_allocation: how group-wise clipping splits the noise (``noise.group_noise_stds``).
        noise: the :class:`~hf_dp.noise.NoiseGenerator` of the run's loader (``noise.privatize`` draws from it).
        group_clipper: the group-wise clipper (``None``: flat clipping).
        allowed_steps: how many steps this ``train()`` may release (``None``: unlimited, ε reported).
        budget_exhausted: a step was withheld, or the run stopped, because the budget is spent.
    """

    def __init__(self, args: Any, dataset: Callable[[], Any], current_args: Callable[[], Any] | None = None):
        self.args = args
        self._dataset = dataset
        self._current_args = current_args
        self.accountant = self.new_accountant()
        self.noise_multiplier: float | None = args.noise_multiplier
        self.noise_allocation: str = args.noise_allocation or (
            "equal_budget" if args.clipping == "per_device" else "global")
        self.noise: NoiseGenerator | None = None
        self.group_clipper: Any = None
        self._engine: Any = None
        self.allowed_steps: int | None = None
        self.steps_at_run_begin = 0
        self.budget_exhausted = False
        self.on_budget_stop: Callable[[], None] | None = None  # the trainer's: stop the training loop
        self._unit_cache: tuple[Any, np.ndarray] | None = None
        self._step_clip: float | None = None  # C at the step's first chunk (flat clipping; begin_step)
        self._sigma_asked: float | None = args.noise_multiplier  # noise_multiplier as train() began (follow_sigma)
        self._target_asked: float | None = args.target_epsilon  # target_epsilon as train() began (follow_target)
        self._delta_asked: float | None = args.target_delta  # target_delta as train() began (follow_target)
        self._fixed: dict[str, Any] | None = None  # FIXED_DURING_RUN as train() began (check_fixed_arguments)
        self._sigma_counted: float | None = None  # the σ the steps allowed were last counted at (follow_set_sigma)
        #: whether any run of this model used a fixed dp_seed, the ordinary generator, shuffled batches (record_fields)
        self.ever: dict[str, bool] = {"fixed_seed": False, "not_secure": False, "shuffled": False}

    # ------------------------------------------------------------------ N, B, q, δ
    @property
    def user_level(self) -> bool:
        return self.args.privacy_unit == "user"

    @property
    def num_units(self) -> int:
        """N: the privacy units of the training set (examples, or users with ``privacy_unit='user'``)."""
        dataset = self._dataset()
        if dataset is None:
            raise ValueError("DPTrainer needs a train_dataset.")
        if self.user_level:
            return int(self.unit_ids().max()) + 1
        return len(dataset)

    def unit_ids(self) -> np.ndarray:
        """User index (0..U-1) of every training example, from ``user_id_column``."""
        dataset = self._dataset()
        if self._unit_cache is not None and self._unit_cache[0] is dataset:
            return self._unit_cache[1]
        column = self.args.user_id_column
        try:
            values = dataset[column]
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise ValueError(f"privacy_unit='user': the training set has no column {column!r}.") from err
        ids = np.unique(np.asarray(list(values)), return_inverse=True)[1].reshape(-1)
        self._unit_cache = (dataset, ids)
        return ids

    @property
    def expected_batch_size(self) -> int:
        """B: per-device batch × accumulation × processes (privacy units per step, in expectation)."""
        a = self.args
        return expected_batch_size(a.per_device_train_batch_size, a.gradient_accumulation_steps, a.world_size)

    @property
    def sample_rate(self) -> float:
        """q = B / N."""
        return sample_rate(self.expected_batch_size, self.num_units, self.user_level)

    @property
    def delta(self) -> float:
        """δ: ``target_delta``, or ``1 / N^1.1`` (below 1/N)."""
        if self.args.target_delta is not None:
            return self.args.target_delta
        return default_delta(self.num_units)

    @property
    def steps_per_epoch(self) -> int:
        """``ceil(N / B)``."""
        return steps_per_epoch(self.num_units, self.expected_batch_size)

    def batch_sampler(self, seed: int) -> PoissonBatchSampler | PoissonUserSampler | ShuffledBatchSampler:
        """The sampling the accountant models: Poisson sampling of rate q of the N users (``privacy_unit='user'``,
        at most ``max_examples_per_user`` examples each) or examples, or, opt-in and labelled heuristic, shuffled
        fixed-size batches; a step's draw is a function of ``(seed, step)`` (``sampling.py``, DESIGN invariant 4)."""
        a = self.args
        common = dict(num_chunks=a.gradient_accumulation_steps, seed=seed, rank=a.process_index,
                      world_size=a.world_size)
        if self.user_level:
            return PoissonUserSampler(self.unit_ids(), self.sample_rate, self.steps_per_epoch,
                                      max_examples_per_user=a.max_examples_per_user, **common)
        if a.poisson_sampling:
            return PoissonBatchSampler(self.num_units, self.sample_rate, self.steps_per_epoch, **common)
        return ShuffledBatchSampler(self.num_units, self.expected_batch_size, **common)

    # ------------------------------------------------------------------ the mechanism of one step
    def begin_step(self, sampler: Any) -> None:
        """At a step's first chunk: the step's draw matches q (:meth:`check_step`), and C is kept, which every chunk
        of the step must clip with (flat clipping reads ``per_sample_max_grad_norm`` at each chunk and for the
        noise)."""
        self._step_clip = self.args.per_sample_max_grad_norm if self.group_clipper is None else None
        self.check_step(sampler)

    def check_step(self, sampler: Any) -> None:
        """At a step's start and release: the q the accountant records (from the arguments and the training set,
        read live) is the rate ``sampler`` drew the step with, in as many chunks as the Trainer runs per step
        (``gradient_accumulation_steps``), and C has not changed since the step's first chunk
        (``guarantee.check_step_mechanism``; DESIGN invariants 4-6), and no argument the run's mechanism was set up
        from has changed (:meth:`check_fixed_arguments`)."""
        if self._current_args is not None:  # trainer.args replaced by a callback during train()
            self.check_arguments_object(self._current_args())
        self.check_fixed_arguments()
        clip = self.args.per_sample_max_grad_norm if self._step_clip is not None else None
        check_step_mechanism(sampler, self.sample_rate, self._step_clip, clip, self.args.gradient_accumulation_steps)
        self.follow_sigma()
        self.follow_target()
        self.follow_set_sigma()

    def fixed_arguments(self) -> dict[str, Any]:
        """The values of :data:`FIXED_DURING_RUN` (and, with group-wise clipping, :data:`FIXED_UNDER_GROUP_CLIPPING`)
        in the arguments now."""
        names = FIXED_DURING_RUN + (FIXED_UNDER_GROUP_CLIPPING if self.group_clipper is not None else ())
        return {name: getattr(self.args, name, None) for name in names}

    def check_arguments_object(self, args: Any) -> None:
        """At train start and at every step's start and release (:meth:`check_step`): the Trainer's arguments
        (``trainer.args``) are the object this mechanism reads. Replaced by another object after construction
        (``trainer.args = other_args``, before ``train()`` or by a callback during it), the Trainer's loop, the σ taken
        at ``train()`` and the card's hyperparameters read the new one while C, q, δ, the clipping and the accountant
        stayed those of the arguments given to the DPTrainer: the run and its card would mix two configurations."""
        if args is self.args:
            return
        raise ValueError(
            "trainer.args was replaced by another arguments object after the DPTrainer was built. The DP mechanism "
            "(C, the sampling rate q, δ, the clipping mode, the accountant, the privacy unit) was set up from the "
            "arguments given at construction and keeps reading them, while the Trainer's loop, σ and the model "
            "card would read the new object. Set fields on trainer.args in place (`trainer.args.learning_rate = "
            "...` between train() calls), or build a new DPTrainer with the new arguments. Nothing of this step was "
            "released."
        )

    def check_fixed_arguments(self) -> None:
        """At a step's start and before its release: the arguments the run's mechanism was set up from when
        ``train()`` began (:data:`FIXED_DURING_RUN`) are unchanged (DESIGN invariant 6: a released step is the
        mechanism recorded). A callback that changed one (``accountant``, ``poisson_sampling``, ``dp_seed``,
        ``secure_mode``, ``clipping``, ...) was silently ignored by the steps while the record and the card reported
        the new value (session 12 review: ``poisson_sampling`` False → True had shuffled batches recorded as Poisson
        sampling, ``dp_seed`` → None had a fixed seed recorded as secret, ``secure_mode`` → True had the ordinary
        generator recorded as secure). Refused before anything more is released."""
        if self._fixed is None:
            return
        now = self.fixed_arguments()
        changed = [(name, old, now[name]) for name, old in self._fixed.items() if now.get(name) != old]
        if changed:
            what = "; ".join(f"{name} from {old!r} to {new!r}" for name, old, new in changed)
            raise RuntimeError(
                f"hf_dp: the arguments changed during train(): {what}. The run's mechanism (accountant, sampler and "
                "its seed, noise source, clipping, noise allocation, privacy unit) was set up from them when train() "
                "began and does not follow them, but the privacy record and the model card read them, so they would "
                "describe steps that did not run. Nothing of this step was released. Set these arguments before "
                "train() (only noise_multiplier, target_epsilon and target_delta are followed during train(); "
                "per_sample_max_grad_norm, clipping_function and automatic_clipping_gamma too with flat clipping, "
                "between steps)."
            )

    def follow_sigma(self) -> None:
        """``noise_multiplier`` changed in the arguments during ``train()`` (a callback's noise schedule): from this
        step on, the noise and the accountant's record use the new σ (each step's σ is recorded where it is released,
        as when ``trainer.noise_multiplier`` is set). Before, the change was silently ignored until the next
        ``train()``. With ``target_epsilon``, the steps still allowed are counted again at the new σ before this step
        is released (a smaller σ spends the budget faster)."""
        asked = self.args.noise_multiplier
        if asked is None or asked == self._sigma_asked:
            return
        check_noise_std(asked, self.args.per_sample_max_grad_norm)
        previous, self.noise_multiplier = self.noise_multiplier, float(asked)
        if self.group_clipper is not None:
            try:
                self.quantile_noise()  # adaptive clipping: σ_new = (σ⁻² − K/(2σ_b)²)^(-1/2) must stay real
            except ValueError:
                self.noise_multiplier = previous
                raise
        logger.info("hf_dp: noise_multiplier changed to %s during train(): steps from here on are noised and "
                    "accounted at σ = %s", asked, asked)
        self._sigma_asked = asked
        if self.args.target_epsilon is not None:  # a smaller σ spends the budget faster (session 12 review: the run
            self._recount_allowance()             # went on to ε = 21 against target_epsilon = 3)

    def follow_target(self) -> None:
        """``target_epsilon`` or ``target_delta`` changed in the arguments during ``train()``: the steps this
        ``train()`` may still take are counted again against the new budget (σ stays the one the run began with),
        before this step is released; a budget already spent stops the run at once (the budget stop: nothing more
        released). Before, the change was ignored: the run spent the old budget while the record and the card
        reported the new target (or ε at the new, smaller δ above the target). A new δ must stay below 1/N
        (``guarantee.check_delta``)."""
        target, delta = self.args.target_epsilon, self.args.target_delta
        if target == self._target_asked and delta == self._delta_asked:
            return
        if delta != self._delta_asked:  # ε is reported at δ: a smaller δ is a larger ε for the same steps (session
            check_delta(self.delta, self.num_units)  # 12 review: δ 1e-3 → 1e-8 ran to ε = 6.8 against target 3)
        self._target_asked, self._delta_asked = target, delta
        self._recount_allowance()

    def follow_set_sigma(self) -> None:
        """σ set on the trainer during ``train()`` (``trainer.noise_multiplier = ...``: the mechanism's attribute, not
        the arguments): each step already records the σ it is noised with; this checks the new σ as at train start
        (σ·C finite; adaptive clipping's split real) and, with ``target_epsilon``, counts the steps still allowed
        again at it before this step is released. Before (session 12 review), σ lowered this way to 0.3 under
        ``target_epsilon`` = 3 ran to ε = 29 (the allowance stayed the one counted at train start)."""
        sigma = self.noise_multiplier
        if self._sigma_counted is None or sigma == self._sigma_counted:
            return
        if sigma is None:
            raise ValueError(
                "hf_dp: trainer.noise_multiplier was set to None during train(): the step cannot be noised. Set a "
                "number (σ), or end this train() and call train() again with target_epsilon to calibrate σ."
            )
        check_noise_std(sigma, self.args.per_sample_max_grad_norm)
        if self.group_clipper is not None:
            self.quantile_noise()  # adaptive clipping: σ_new = (σ⁻² − K/(2σ_b)²)^(-1/2) must stay real
        if self.args.target_epsilon is not None:
            self._recount_allowance()
        self._sigma_counted = sigma

    def _recount_allowance(self) -> None:
        """The steps this ``train()`` may still release, counted again at the current σ against the current
        ``target_epsilon`` (:func:`steps_within_budget`), after a change of either during ``train()``."""
        planned = self.accountant.planned_steps
        remaining = max((planned if planned is not None else self.accountant.steps) - self.accountant.steps, 0)
        more = steps_within_budget(self.epsilon_after, remaining, self.args.target_epsilon)
        self.allowed_steps = None if more is None else self.accountant.steps - self.steps_at_run_begin + more
        self._sigma_counted = self.noise_multiplier
        logger.info("hf_dp: during train(), σ = %s and target_epsilon = %s: %s more step(s) allowed",
                    self.noise_multiplier, self.args.target_epsilon, "unlimited" if more is None else more)

    # ------------------------------------------------------------------ the noise
    def new_accountant(self) -> PrivacyAccountant:
        return PrivacyAccountant(accountant=self.args.accountant, eps_error=self.args.accountant_eps_error)

    def new_noise(self, seed: int) -> NoiseGenerator:
        """The run's noise source (with ``secure_mode``, cryptographically secure: ``noise.py``)."""
        self.noise = NoiseGenerator(seed, secure_mode=self.args.secure_mode)
        return self.noise

    def set_clipping(self, group_clipper: Any, engine: Any) -> None:
        """The clipping the noise is calibrated to: the group clipper (``None``: flat) and the clipping engine (its
        ``params``, read at each use, give each group's dimension)."""
        self.group_clipper = group_clipper
        self._engine = engine

    @property
    def params(self) -> dict[str, Any]:
        """The clipped parameters by name (the engine's)."""
        return {} if self._engine is None else self._engine.params

    @property
    def noise_std(self) -> float:
        """Std of the noise on the summed clipped gradient under flat clipping: σ · C."""
        return float(self.noise_multiplier) * self.args.per_sample_max_grad_norm

    def quantile_noise(self) -> tuple[float, float]:
        """``(σ_new, σ_b)`` for adaptive clipping (He et al. 2023, Prop. 3.1); ``(σ, 0)`` otherwise."""
        gc = self.group_clipper
        if gc is None or not gc.adaptive:
            return float(self.noise_multiplier), 0.0
        fraction = None if self.args.quantile_noise_multiplier is not None else self.args.quantile_budget_fraction
        return split_noise_for_quantiles(self.noise_multiplier, gc.num_groups, fraction,
                                         self.args.quantile_noise_multiplier)

    def noise_stds(self) -> float | dict[str, float]:
        """Noise std on each parameter's summed clipped gradient: ``σ C`` (flat) or per group (``noise.py``)."""
        gc = self.group_clipper
        if gc is None:
            return self.noise_std
        sigma_grad, _ = self.quantile_noise()
        dims = [sum(self.params[n].numel() for n in g.params) for g in gc.groups]
        stds, _ = group_noise_stds(gc.thresholds.tolist(), dims, self.noise_allocation, sigma_grad)
        return {n: std for g, std in zip(gc.groups, stds) for n in g.params}

    def released_noise_std(self) -> float | dict[int, float]:
        """Std of the noise in each coordinate of the released gradient: :meth:`noise_stds` over B
        (``noise.privatize``); ``{id(param): std}`` with group-wise noise (read by DP-AdamBC, ``optim.py``)."""
        stds = self.noise_stds()
        batch = self.expected_batch_size
        if isinstance(stds, dict):
            return {id(self.params[n]): s / batch for n, s in stds.items()}
        return float(stds) / batch

    # ------------------------------------------------------------------ calibration and the budget
    def calibrate(self, steps: int, history: Sequence[MechanismRecord] = ()) -> float:
        """σ meeting ``target_epsilon`` at δ after ``steps`` more steps after ``history``: the one calibration
        (``plan.calibrate_noise``) that train start, the plan and the record use."""
        return calibrate_noise(self.args.target_epsilon, self.delta, self.sample_rate, steps, self.args.accountant,
                               self.args.accountant_eps_error, history)

    def check_budget_left(self) -> None:
        """A second ``train()`` with ``target_epsilon``: refuse when the earlier runs already spent the budget."""
        check_budget_left(self.accountant, self.args.target_epsilon, self.delta)

    def epsilon_after(self, steps: int) -> float:
        """ε at δ after ``steps`` more steps at (σ, q) (``plan.epsilon_after``: as the calibration computes it)."""
        return epsilon_after(self.accountant, self.noise_multiplier, self.sample_rate, steps, self.delta)[0]

    def begin_run(self, remaining: int) -> None:
        """At train start: σ calibrated to what is left of ``target_epsilon`` for the ``remaining`` steps (unless
        given), checked (σ·C finite; adaptive clipping's σ_new real), the accountant's planned steps and the steps
        the budget allows."""
        args = self.args
        self._sigma_asked, self._target_asked = args.noise_multiplier, args.target_epsilon
        self._delta_asked, self._fixed = args.target_delta, None
        if self.noise_multiplier is None:
            self.check_budget_left()
            try:
                self.noise_multiplier = self.calibrate(remaining, self.accountant.history)
            except ValueError as err:
                if not self.accountant.steps:
                    raise
                raise ValueError(
                    f"No noise multiplier reaches target_epsilon={args.target_epsilon} after the "
                    f"{self.accountant.steps} steps this model already took: {err} Train fewer steps, or start from "
                    "a fresh model with a new DPTrainer."
                ) from err
            logger.info("hf_dp: calibrated noise multiplier σ=%.4f for %d steps at q=%.5f to reach ε=%s, δ=%.3g",
                        self.noise_multiplier, remaining, self.sample_rate, args.target_epsilon, self.delta)
        check_noise_std(self.noise_multiplier, args.per_sample_max_grad_norm)
        if self.group_clipper is not None:
            self.quantile_noise()  # adaptive clipping: fails loudly if σ_new = (σ⁻² − K/(2σ_b)²)^(-1/2) is not real
        self.accountant.planned_steps = self.accountant.steps + remaining
        self.allowed_steps = steps_within_budget(self.epsilon_after, remaining, args.target_epsilon)
        # The allowance counts from here: the Trainer may begin its training loop again within one train()
        # (auto_find_batch_size after running out of memory), with the steps released before already counted.
        self.steps_at_run_begin = self.accountant.steps
        self._fixed = self.fixed_arguments()  # what the mechanism is set up from (check_fixed_arguments)
        self._sigma_counted = self.noise_multiplier  # the σ the allowance is counted at (follow_set_sigma)
        self.accountant.use(args.accountant, args.accountant_eps_error)  # changed since the last train(): followed
        self.ever["fixed_seed"] |= args.dp_seed is not None
        self.ever["not_secure"] |= not args.secure_mode
        self.ever["shuffled"] |= not args.poisson_sampling

    def resume_from(self, record: Any) -> None:
        """Resuming from a checkpoint's :class:`~hf_dp.record.PrivacyRecord`: its accountant (ε continues from its
        mechanisms), its σ unless ``noise_multiplier`` is given, its clipping thresholds; a changed q or C is said
        (the accountant composes both mechanisms)."""
        self.accountant = record.accountant
        self.ever["fixed_seed"] |= record.dp_seed == "fixed"
        self.ever["not_secure"] |= not record.secure_mode
        self.ever["shuffled"] |= not record.poisson_sampling
        if self.group_clipper is not None and record.group_clipping:
            self.group_clipper.load_state_dict(record.group_clipping)  # thresholds continue where they were
        if self.args.noise_multiplier is None:
            self.noise_multiplier = record.noise_multiplier
        else:
            self.noise_multiplier = self.args.noise_multiplier
        if abs(record.sample_rate - self.sample_rate) > 1e-12 or \
                record.per_sample_max_grad_norm != self.args.per_sample_max_grad_norm:
            warnings.warn(
                "Resuming with a different sampling rate or clipping norm than the checkpoint; the accountant "
                "composes both mechanisms.",
                UserWarning,
                stacklevel=4,
            )

    def budget_allows(self, n: int) -> bool:
        """Whether ``n`` more steps of this ``train()`` stay within the budget (a step beyond it is never
        released)."""
        return budget_allows(self.accountant.steps - self.steps_at_run_begin, n, self.allowed_steps)

    def stop_for_budget(self) -> None:
        """The DP step released nothing: one more step would exceed the budget; the training loop stops
        (``on_budget_stop``)."""
        self.budget_exhausted = True
        if self.on_budget_stop is not None:
            self.on_budget_stop()

    def group_logs(self) -> dict[str, float]:
        """Group-wise clipping's thresholds and privatized unclipped fractions per group, for the logs (only released
        quantities)."""
        gc = self.group_clipper
        c = gc.thresholds
        out = {"clip_threshold_min": float(c.min()), "clip_threshold_median": float(c.median()),
               "clip_threshold_max": float(c.max())}
        per_group = gc.num_groups <= 8
        if per_group:
            out.update({f"clip_threshold/{g.name}": float(v) for g, v in zip(gc.groups, c)})
        if gc.released_unclipped_fraction is not None:
            b = gc.released_unclipped_fraction
            out["clipped_fraction_mean"] = float(1 - b.mean())
            if per_group:
                out.update({f"clipped_fraction/{g.name}": float(1 - v) for g, v in zip(gc.groups, b)})
        return {k: round(v, 6) for k, v in out.items()}

    # ------------------------------------------------------------------ the record
    def recorded_args(self) -> SimpleNamespace:
        """The arguments as the record and the guarantee notes describe the model's runs: during and after a run the
        values the mechanism was set up from (:data:`FIXED_DURING_RUN`, whatever the arguments say since), and
        across runs the weakest of them (a fixed ``dp_seed``, the ordinary generator or shuffled batches in any run
        of this model, resumed ones included, stay said)."""
        args = SimpleNamespace(**{**vars(self.args), **(self._fixed or {})})
        if self.ever["fixed_seed"] and args.dp_seed is None:
            args.dp_seed = "an earlier run's"
        args.secure_mode = bool(args.secure_mode) and not self.ever["not_secure"]
        args.poisson_sampling = bool(args.poisson_sampling) and not self.ever["shuffled"]
        return args

    def record_fields(self, sigma: float | None) -> dict[str, Any]:
        """The mechanism's part of the run's :class:`~hf_dp.record.PrivacyRecord` (σ given: the run's, or a planned
        one): δ, σ, q, N, B, C, the target, the clipping and its thresholds, the noise allocation, the unit, the
        sampling, the accountant's name and the noise source."""
        args = self.recorded_args()
        gc = self.group_clipper
        thresholds = adaptive = group_state = None
        if gc is not None:
            thresholds = plain(gc.thresholds)
            names = [g.name for g in gc.groups]
            if isinstance(thresholds, list) and len(names) == len(thresholds):
                thresholds = dict(zip(names, thresholds))
            group_state = gc.state_dict()
            if gc.adaptive:
                adaptive = {"target_quantile": plain(gc.target_quantile), "quantile_lr": plain(gc.quantile_lr)}
                try:  # (σ of the gradient, σ_b of the clip counts); composed they are the accounted σ (Prop. 3.1)
                    sigma_grad, sigma_b = self.quantile_noise()
                    adaptive.update(gradient_noise_multiplier=float(sigma_grad), count_noise_multiplier=float(sigma_b))
                except Exception:  # noqa: BLE001 - only informative (σ not known yet)
                    pass
        user = self.user_level
        return dict(
            delta=float(self.delta),
            noise_multiplier=plain(sigma),
            sample_rate=float(self.sample_rate),
            num_examples=int(self.num_units),
            expected_batch_size=int(self.expected_batch_size),
            per_sample_max_grad_norm=float(args.per_sample_max_grad_norm),
            target_epsilon=plain(args.target_epsilon),
            clipping=str(plain(args.clipping)),
            poisson_sampling=bool(args.poisson_sampling),
            accountant_name=str(self.accountant.accountant),
            noise_allocation=str(plain(self.noise_allocation or "global")),
            group_thresholds=thresholds,
            adaptive_clipping=adaptive,
            group_clipping=group_state,
            privacy_unit=str(args.privacy_unit or "example"),
            user_id_column=args.user_id_column if user else None,
            max_examples_per_user=args.max_examples_per_user if user else None,
            user_contribution=args.user_contribution if user else None,
            num_rows=len(self._dataset()) if user else None,
            secure_mode=bool(args.secure_mode),
            dp_seed="secret" if args.dp_seed is None else "fixed",
        )

    # ------------------------------------------------------------------ the plan's banner
    def plan(self, steps: int, trainable_parameters: int, history: Sequence[MechanismRecord] = ()) -> dict[str, Any]:
        """The privacy plan of a fresh run of ``steps`` steps after the model's earlier ``history``
        (:func:`~hf_dp.plan.plan_privacy`, the same function as ``hf-dp plan``): σ from ``noise_multiplier`` or
        calibrated as train start will calibrate it."""
        a = self.args
        return plan_privacy(
            num_examples=self.num_units, per_device_train_batch_size=a.per_device_train_batch_size,
            gradient_accumulation_steps=a.gradient_accumulation_steps, world_size=a.world_size, steps=steps,
            target_epsilon=a.target_epsilon, noise_multiplier=a.noise_multiplier, target_delta=self.delta,
            trainable_parameters=trainable_parameters, per_sample_max_grad_norm=a.per_sample_max_grad_norm,
            accountant=a.accountant, accountant_eps_error=a.accountant_eps_error, clipping=a.clipping,
            privacy_unit=a.privacy_unit or "example", poisson_sampling=a.poisson_sampling, history=history,
        )

    def plan_log(self, remaining: int, trainable_parameters: int, earlier_steps: int | None = None
                 ) -> tuple[dict[str, Any], str | None]:
        """At train start: the budget as one log block, and the advice when the noise dominates (``plan.py``:
        the same functions as :func:`~hf_dp.plan.plan_privacy`). ``earlier_steps``: the steps of the model's earlier
        DP runs (``None``: it has none)."""
        args = self.args
        d = trainable_parameters
        steps = remaining if self.allowed_steps is None else min(remaining, self.allowed_steps)
        planned_epsilon, acc = epsilon_after(self.accountant, self.noise_multiplier, self.sample_rate, steps,
                                             self.delta)
        report = noise_to_signal_report(self.noise_multiplier, d, self.sample_rate * self.num_units, steps,
                                        self.expected_batch_size)
        block = {
            # a target only when the user set one (with noise_multiplier=σ the run has none: ε is what it plans)
            **({} if args.target_epsilon is None else {"dp_target_epsilon": args.target_epsilon}),
            "dp_planned_epsilon": round(planned_epsilon, 4),
            "delta": self.delta,
            "dp_noise_multiplier": round(float(self.noise_multiplier), 6),
            "dp_sample_rate": self.sample_rate,
            "dp_expected_batch_size": self.expected_batch_size,
            "dp_steps": steps,
            "dp_per_sample_max_grad_norm": args.per_sample_max_grad_norm,
            "dp_clipping": args.clipping,
            "dp_privacy_unit": args.privacy_unit,
            **({} if earlier_steps is None else {"dp_earlier_steps": earlier_steps}),
            "dp_accountant": acc.accountant_used,
            "dp_trainable_parameters": d,
            "dp_noise_to_signal": round(report["noise_to_signal"], 4),
            "dp_noise_to_signal_over_run": round(report["noise_to_signal_over_run"], 4),
        }
        return block, report["advice"]
