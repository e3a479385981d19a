"""``DPTrainer``: the Hugging Face ``Trainer`` where every optimizer step is one DP-SGD / DP-Adam step.

One logical step (Abadi et al. 2016; Li et al. 2022, §2 and App. A for DP-Adam):

1. a Poisson-sampled batch (``sampling.py``) arrives as ``gradient_accumulation_steps`` chunks, each split further
   into micro-batches of at most ``per_device_train_batch_size`` examples (memory only);
2. for each micro-batch, one forward and one backward of ``Σ_i L_i`` (each example's own loss, ``losses.py``)
   give every example's gradient norm and the clipped sum ``Σ_i c_i g_i`` (``clipping/``), without per-example
   gradients and without the unclipped gradient;
3. at the last chunk, Gaussian noise is added once and the sum divided by the expected batch size (``noise.py``),
   the result is written to ``param.grad``, and the accountant records the step (``accounting.py``);
4. the Trainer then steps the user's optimizer and scheduler as usual.

Steps 2-3 are the DP step strategy (``clipping/step.py``: ``clipping/local.py`` on one process or under DDP,
``clipping/fsdp.py`` under FSDP2), chosen once per model and given its pieces, never the trainer; the run-time checks
of the guarantee are in ``guarantee.py``. The trainer keeps the ``Trainer`` overrides and the wiring.
"""

from __future__ import annotations

import logging
import os
import secrets  # noqa: F401 - the secret DP seed's source (loader.shared_seed); patched as hf_dp.trainer.secrets
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from .accounting import PrivacyAccountant
from .arguments import DPTrainingArguments, NotPrivateWarning
from .audit import audit_report
from .chunked_loss import ChunkedLMLoss
from .clipping.checks import computes_in_half
from .clipping.engine import ClippingEngine, train_without_dropout
from .clipping.fsdp import FSDPClippingEngine, FSDPFlatClipping, check_fsdp_supported, fsdp_requested
from .clipping.local import LocalDPStep, first_step_check
from .clipping.modes import GroupClipper, build_groups, group_clipper_from_args
from .clipping.step import INDEX_KEY, DPStep, RealisedLoss, StepPieces, micro_batch_bounds, slice_batch
from .counterfactual import (
    alone_rtol,
    check_first_step_alone,
    check_known_dependences,
    collated_on_device,
    first_batch_features,
    hard_batch,
    longest_position,
)
from .evaluation import EvalDataWiring
from .guarantee import (
    ReleasedStateGuard,
    StepGradientGuard,
    check_batch_rows,
    check_delta,
    check_no_gradient_hooks,
    check_not_compiled,
    check_optimizer_holds,
    check_optimizer_updates_in_step,
    check_something_trainable,
    check_step_gradients,
    check_train_loader,
    check_train_sampler_not_overridden,
    check_trainable_set_change,
    check_training_setup,
    describe_difference,
    discard_stale_gradients,
    nonfinite_message,
    overriding_class,
    setting_notes,
    trainable_set_difference,
)
from .history import ModelHistory, earlier_runs_message
from .loader import dp_train_loader, is_empty, shared_seed, training_collator, training_rows
from .losses import (
    PerExampleLoss,
    check_loss_per_example,
    check_models_own_loss,
    check_rows_are_examples,
    default_per_example_loss,
    is_seq2seq_lm,
    label_smoothed_default,
    labels_to_compare,
    seq2seq_model_inputs,
    user_loss_given,
)
from .mechanism import Mechanism
from .optim import bias_corrected_adam, check_adam_bc_optim
from .peft_support import (
    adapter_advice,
    apply_peft_config,
    check_adapter_objective,
    data_initialisation_note,
    data_initialisation_warning,
    per_example_prompts,
)
from .plan import NOISE_TO_SIGNAL_WARNING  # noqa: F401 - imported from here by callers
from .record import PrivacyRecord, describe_optimizer, describe_trained_parameters, model_base_model, plain
from .release import (
    DP_STATE_NAME,
    STAGING_DIR,
    card_hyperparameters,
    card_inputs,
    checkpoint_push,
    redact_output_dir,
    release_notes,
    write_model_card,
)
from .sampling import PoissonBatchSampler, ShuffledBatchSampler, check_draw_is_current
from .units import UnitDetail

__all__ = ["DPTrainer", "DP_STATE_NAME"]

logger = logging.getLogger(__name__)

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _DPCallback(TrainerCallback):
    """The DPTrainer's own hooks into the loop: calibration and the loader check at train start, sampler epochs,
    non-finite example reports, budget stops."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.mechanism.check_arguments_object(self.trainer.args)  # not replaced since construction
        # A step left half-done by an interrupted train(), or by the attempt that ran out of memory before
        # find_executable_batch_size re-ran the loop, is dropped (DESIGN invariant 11); the logged loss restarts.
        self.trainer._dp_step.reset()
        self.trainer._realised_loss.reset_run()
        self.trainer._epoch_begun = False
        self.trainer._dp_on_train_begin(state, kwargs.get("train_dataloader"))
        check_optimizer_updates_in_step(self.trainer.optimizer)  # LOMO, *_layerwise: would train nothing
        if self.trainer._fsdp is None:  # (FSDP2 holds the sharded parameters) a trainable one not held: trains nothing
            check_optimizer_holds(self.trainer.optimizer, self.trainer.model, "at train start")
        # a gradient hook cannot act per example (FSDP2 too: it runs the sharded parameters' post-accumulate hooks on
        # the reduced clipped sum before the noise)
        check_no_gradient_hooks(self.trainer.model, "at train start")
        self.trainer._start_state_guard()

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self.trainer._dp_sampler
        if sampler is not None:
            sampler.set_first_step(self.trainer._first_draw_of_epoch(state))
        self.trainer._epoch_begun = True

    def on_train_end(self, args, state, control, **kwargs):
        # a callback that stopped the run between two chunks of a step: the half-done step is dropped now
        self.trainer._dp_step.discard_step("training ended between two gradient accumulation chunks of the step")

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._report_nonfinite(state.global_step)
        if state.global_step < state.max_steps and not self.trainer._budget_allows(1):
            logger.warning(
                "hf_dp: stopping at step %d: one more step would exceed the privacy budget ε=%s (δ=%s). "
                "The model is saved with its privacy state.",
                state.global_step, args.target_epsilon, self.trainer.target_delta,
            )
            self.trainer.budget_exhausted = True
            control.should_training_stop = True
            control.should_save = True
        return control


class _DPGradientCheck(TrainerCallback):
    """Before every optimizer step (transformers 5 calls ``on_pre_optimizer_step`` after the step's last
    ``training_step`` and before ``optimizer.step()``): the gradients are this step's DP release (``guarantee.py``).

    It is the first callback, so it sees the gradients as the DP step left them. Callbacks after it (flatness
    regularisers, a data-independent term added to ``.grad``) post-process the released gradient.
    """

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer._fsdp is not None:  # (without FSDP: in check_step_gradients) FSDP2 runs post-accumulate hooks
            check_no_gradient_hooks(self.trainer.model, "before this optimizer step; nothing of it applied")
        self.trainer._check_step_gradients()
        guard = self.trainer._state_guard
        if not guard.hooked:  # else the optimizer's own pre-step hook checks, after every callback
            guard.check("before_optimizer_step")

    def on_optimizer_step(self, args, state, control, **kwargs):
        guard = self.trainer._state_guard
        if not guard.hooked:  # else the optimizer's own post-step hook did
            guard.optimizer_stepped()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._state_guard.check("train_end")
        self.trainer._state_guard.stop()


class _DPHistoryCallback(TrainerCallback):
    """The model carries its privacy history (``hf_dp/history.py``, DESIGN invariant 13): at train start and end the
    history (earlier runs and this run's live entry) is written onto the model's configs and parameters; before every
    optimizer step (the accountant has just recorded the step) this run's entry is brought up to date, so a model
    taken from an interrupted ``train()`` carries the steps it took."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._record_model_history(tag=True)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._record_model_history(tag=False)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._record_model_history(tag=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._record_model_history(tag=True)

    def dp_guarantee_notes(self) -> list[str]:
        """What was done to the model before this run that the guarantee does not cover: adapter weights that PEFT
        initialised from data (EVA, CorDA, LoRA-GA; ``peft_support.data_initialisation_note``)."""
        note = data_initialisation_note(self.trainer._unwrapped_model())
        return [] if note is None else [note]


class _StepHooks:
    """The trainer's side of the DP step (``clipping.step.StepHooks``): each method looks the trainer's own up when
    called, so a subclass's override or an instance attribute set later (``DPSFTTrainer._segment_ids``, a
    benchmark's ``_self_check``) takes effect."""

    def __init__(self, trainer: DPTrainer):
        self._trainer = trainer

    def prepare_inputs(self, inputs: dict) -> dict:
        return self._trainer._prepare_inputs(inputs)

    def loss_context(self) -> Any:
        return self._trainer.compute_loss_context_manager()

    def per_example_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._trainer.per_example_loss(*args, **kwargs)

    def model_inputs(self, model: torch.nn.Module, inputs: dict, labels: torch.Tensor) -> dict:
        return self._trainer._model_inputs(model, inputs, labels)

    def example_losses(self, net: Any, inputs: dict, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        one = labels.shape[0] == 1 and "segments" not in kwargs and self._trainer._dp_step.pieces.rows_per_example == 1
        return check_loss_per_example(self._trainer._example_losses(net, inputs, labels, **kwargs),  # losses.py
                                      rows=1 if one else None)

    def micro_batches(self, *args: Any) -> list:
        return self._trainer._micro_batches(*args)

    def segment_ids(self, inputs: dict) -> torch.Tensor | None:
        return self._trainer._segment_ids(inputs)

    def first_step_check(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        self._trainer._self_check(net, micro, labels)

    def check_batch(self) -> tuple[dict, torch.Tensor] | None:
        return self._trainer._check_batch()

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self._trainer.accelerator.unwrap_model(model)

    def sync_gradients(self) -> bool:
        return self._trainer.accelerator.gradient_state.sync_gradients

    def optimizer(self) -> Any:
        return self._trainer.optimizer

    def check_release(self) -> None:
        self._trainer._state_guard.before_release()
        self.check_step_mechanism()

    def check_step_mechanism(self) -> None:
        self._trainer.mechanism.check_step(self._trainer._dp_sampler)  # q and C are those the step ran with


def _mechanism_attribute(name: str, doc: str, settable: bool = False) -> property:
    """A ``DPTrainer`` attribute that is the run's :class:`~hf_dp.mechanism.Mechanism`'s ``name``."""

    def get(self: DPTrainer) -> Any:
        return getattr(self.mechanism, name)

    def set_(self: DPTrainer, value: Any) -> None:
        setattr(self.mechanism, name, value)

    return property(get, set_ if settable else None, doc=doc)


def _fsdp_not_enabled_message(distributed_type: Any, world_size: int) -> str:
    """FSDP was asked for but accelerate did not enable it: what runs instead, and why."""
    return (
        "hf_dp: FSDP was requested (TrainingArguments fsdp=... or `accelerate launch --use_fsdp`) but accelerate "
        f"did not enable it (distributed_type={distributed_type}): this run is "
        + ("multi-process DDP, every rank holding the whole model" if world_size > 1 else "a single process")
        + ". accelerate switches to FSDP only for processes on accelerators "
        "(accelerate/state.py, AcceleratorState.__init__: DistributedType.FSDP is set only when the type is "
        "MULTI_GPU/MULTI_XPU/MULTI_NPU/...; a CPU-only job is MULTI_CPU), so on CPU the FSDP plugin is dropped "
        "silently. The DP guarantee is unaffected (DDP is exact for every clipping mode); memory is not sharded."
    )


def _check_compute_loss_not_overridden(cls: type) -> None:
    """Refuse a class whose ``compute_loss`` the DP step would ignore (it never calls ``compute_loss`` in training).

    Checked before ``Trainer.__init__`` runs, so that ``class X(DPTrainer, SomeTrlTrainer)`` (every trl trainer
    overrides ``compute_loss``) is refused with this reason, not with whatever its ``__init__`` trips over first
    (e.g. a trl config field missing from ``DPTrainingArguments``).
    """
    check_train_sampler_not_overridden(cls)  # the same for a sampler the DP train loader would ignore
    owner = overriding_class(cls, "compute_loss")
    if owner in (Trainer, DPTrainer) or getattr(owner, "_dp_compute_loss_is_not_trained", False):
        return
    trl_hint = ""
    if owner.__module__.split(".")[0] == "trl":
        trl_hint = (" For trl's SFTTrainer use hf_dp.DPSFTTrainer with hf_dp.DPSFTConfig; other trl trainers (their "
                    "losses span pairs, reference models or generations) are not supported by DPTrainer.")
    raise ValueError(
        f"{owner.__name__} overrides compute_loss, but DPTrainer never calls compute_loss in training (each "
        "example's loss is computed by per_example_loss, then clipped), so your loss would be silently "
        "ignored in training and used only in evaluation. Pass per_example_loss=fn with fn(outputs, labels) "
        "-> one loss per example (Tensor[B]) instead; for evaluation-only changes override prediction_step." + trl_hint
    )


class _ExamplesAloneWiring:
    """``DPTrainer``'s side of DESIGN invariant 12, "an example's loss is its own" (``hf_dp/counterfactual.py``):
    where the training collator, the rows, the hard batch and the example layout come from, for the check at the
    first step and the refusal of known dependences at train start. Subclasses override the collators
    (``DPSFTTrainer``) and the layout (``PreferencePairsDP``). Also the chunked loss's comparison with the model's
    own (invariant 2: an example's loss is the model's own on it)."""

    def _default_loss(self, model: torch.nn.Module) -> tuple[PerExampleLoss, str]:
        """The per-example loss hf_dp trains for ``model`` without ``per_example_loss=`` (``default_per_example_loss``;
        ``DPSFTTrainer``: per packed example), with the Trainer's ``label_smoothing_factor`` as its label smoother
        applies it (``losses.label_smoothed_default``)."""
        loss, task = default_per_example_loss(model)
        return label_smoothed_default(model, loss, task, getattr(self.label_smoother, "epsilon", 0.0)), task

    def _check_loss_is_the_models_own(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """Before the first update, on the micro-batch's first row: hf_dp's default per-example loss equals the loss
        the model's own forward returns for that row as a batch of one (what the plain ``Trainer`` trains:
        ``losses.check_models_own_loss``); with ``lm_loss_chunk_size``, the chunked loss equals the per-example
        loss of the model's full logits (``ChunkedLMLoss.check_against_model``)."""
        row = self._slice_batch(micro, slice(0, 1), labels.shape[0])
        row_labels = labels_to_compare(self.task, row, labels[:1])
        half = computes_in_half(self.args, net)
        with self.compute_loss_context_manager(), train_without_dropout(net):
            if self.per_example_loss is self._own_loss and self._segment_ids(row) is None:
                check_models_own_loss(net, self._model_inputs(net, row, row_labels), row_labels,
                                      self.per_example_loss, half)
            if self._chunked is not None:
                self._chunked.check_against_model(
                    row, row_labels, self._segment_ids,
                    lambda b, y, **kw: self.per_example_loss(net(**self._model_inputs(net, b, y)), y, **kw),
                    lambda b, y, **kw: self._example_losses(net, b, y, **kw), half, net)

    def _training_collator(self, loader: Any = None) -> Any:
        """The collator the DP loader runs (the user's, with the Trainer's column removal), without hf_dp's
        wrapper; ``None`` without a DP loader."""
        return training_collator(self._dp_loader(loader))

    def _alone_collator(self, loader: Any = None) -> Any:
        """How an example sampled alone is collated: the training collator (``DPSFTTrainer`` with packing: trl's
        unpacked collator)."""
        return self._training_collator(loader)

    def _training_rows(self, loader: Any = None) -> Any:
        """The training set's raw rows (what the collator receives), or ``None`` without a DP loader."""
        return training_rows(self._dp_loader(loader))

    def _dp_loader(self, loader: Any = None) -> Any:
        """``loader``, or the train loader of the running ``train()`` (None outside one)."""
        return loader if loader is not None else getattr(self.callback_handler, "train_dataloader", None)

    def _hard_batch(self, loader: Any = None) -> tuple[list, dict, torch.Tensor] | None:
        """The training set's shortest and longest rows collated together, on the device
        (``counterfactual.hard_batch``); ``None`` with fewer than two rows or no DP loader."""
        rows, collate = self._training_rows(loader), self._training_collator(loader)
        if rows is None or collate is None:
            return None
        return hard_batch(rows, collate, min(3, max(2, self.args.per_device_train_batch_size)), _StepHooks(self))

    def _check_examples_alone(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """Once per run, before the first update: each example's loss and gradient in its batch equal the example's
        alone, on the first micro-batch and on :meth:`_hard_batch` (``counterfactual.check_first_step_alone``)."""
        collate, alone = self._training_collator(), self._alone_collator()
        if collate is None or alone is None:
            logger.warning("hf_dp: no DP train loader: the examples were not compared with themselves alone.")
            return
        segments = self._segment_ids(micro)
        num = labels.shape[0] if segments is None else int(segments.max()) + 1
        num //= self._dp_step.pieces.rows_per_example
        indices, rows = getattr(self, "_chunk_indices", None), self._training_rows()
        features, random_rows = (None, False) if indices is None or len(indices) < num or rows is None else \
            first_batch_features(rows, indices, num)  # re-read: a random transform draws again (counterfactual.py)
        check_first_step_alone(self.clipping_engine, _StepHooks(self), net, micro, labels, collate, alone, features,
                               self._hard_batch(), alone_rtol(net, computes_in_half(self.args, net)),
                               **self._alone_layout(), random_rows=random_rows)

    def _alone_layout(self) -> dict:
        """How an example is laid out for the counterfactual check (``check_first_step_alone``'s ``extras`` and
        ``example_of_row``); every model row one example here (``PreferencePairsDP``: a row of two sequences)."""
        return {}

    def _check_known_dependences(self, loader: Any = None) -> None:
        """At train start: refuse what makes an example's loss depend on other rows by configuration (a rope scaling
        computed from the batch; left padding with positions from the padded layout), with the way out
        (``counterfactual.check_known_dependences``)."""
        net = self._unwrapped_model()
        hard = self._hard_batch(loader)
        if hard is None:
            return check_known_dependences(net)
        rows = self._training_rows(loader)
        longest = lambda: longest_position(rows, hard[0], hard[1])  # noqa: E731 - only read for rope
        if self._fsdp is not None:  # the model is not wrapped yet: its configuration only
            return check_known_dependences(net, longest=longest)
        hooks = _StepHooks(self)
        with self.compute_loss_context_manager():
            return check_known_dependences(net, hard[1], hard[2], lambda b, lab: net(**hooks.model_inputs(net, b, lab)),
                                           rtol=alone_rtol(net, computes_in_half(self.args, net)), longest=longest)


class _HistoryAndUnitWiring:
    """``DPTrainer``'s side of the model's privacy history (``hf_dp/history.py``: earlier runs compose, this run is
    recorded on the model) and of what one privacy unit is (``hf_dp/units.py``)."""

    def _start_history(self, model: torch.nn.Module) -> None:
        """A new model for this trainer: its accountant starts with the mechanisms of the earlier DP runs the model
        carries (any parameter, trainable or frozen; ``hf_dp/history.py``), so ε composes and ``target_epsilon``
        budgets what is left. Said once, as a warning."""
        try:
            unwrapped = self.accelerator.unwrap_model(model)
        except Exception:  # noqa: BLE001 - unwrap only fails for exotic wrappers
            unwrapped = model
        self._history = ModelHistory.of_model(unwrapped)
        self.accountant.history = self._history.earlier_mechanisms()
        msg = earlier_runs_message(self._history, str(self.args.privacy_unit or "example"),
                                   self.args.user_id_column if self.user_level else None,
                                   budgeted=self.args.target_epsilon is not None)
        for said in (msg, data_initialisation_warning(unwrapped)):  # adapters initialised from data: peft_support
            if said is not None:
                warnings.warn(said, UserWarning, stacklevel=4)

    def _record_model_history(self, tag: bool) -> None:
        """This run's entry brought up to date from the accountant; with ``tag``, the model's configs and parameters
        (re)written with the history (``hf_dp/history.py``)."""
        if self.train_dataset is None:
            return
        description: dict[str, Any] = {"delta": float(self.target_delta),
                                       "privacy_unit": str(self.args.privacy_unit or "example"),
                                       "user_id_column": self.args.user_id_column if self.user_level else None,
                                       "num_examples": int(self.num_examples_private)}
        if tag:
            description["dp_guarantee"] = self.dp_guarantee
            description["privacy_unit_detail"] = self._privacy_unit_detail()
        self._history.update(self.accountant.history, **description)
        if tag:
            self._history.tag(self._unwrapped_model())

    # ------------------------------------------------------------------ the privacy unit (units.py)
    def _check_privacy_unit(self) -> None:
        """Rows that look like fixed-length blocks of concatenated text (``hf_dp/units.py``, transformers' run_clm
        ``group_texts``): the unit protected is a block, not a document. Said once per training set, as a warning;
        the record and the card say what one unit is. Not checked with ``privacy_unit="user"`` (the unit is
        declared by the id column)."""
        msg = self._unit_detail.check(self.train_dataset, self.processing_class,
                                      getattr(self._unwrapped_model(), "config", None), declared=self.user_level)
        if msg is not None:
            warnings.warn(msg, UserWarning, stacklevel=4)

    def _privacy_unit_detail(self) -> str | None:
        units = getattr(self, "_unit_detail", None)  # (None while Trainer.__init__ runs)
        return None if units is None else units.detail(self.train_dataset)


class DPTrainer(_ExamplesAloneWiring, _HistoryAndUnitWiring, EvalDataWiring, Trainer):
    """A ``transformers.Trainer`` that trains with differential privacy (DP-SGD; DP-Adam with AdamW).

    Use it exactly like ``Trainer``, with :class:`~hf_dp.DPTrainingArguments`::

        args = DPTrainingArguments(output_dir="out", target_epsilon=3.0, per_sample_max_grad_norm=0.1,
                                   per_device_train_batch_size=32, gradient_accumulation_steps=8)
        trainer = DPTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
        trainer.train()          # ε is logged as `epsilon`; trainer.privacy_spent() reports it

    Args:
        per_example_loss: ``fn(outputs, labels) -> Tensor[B]``, each example's own loss. Defaults by model head:
            causal LM, masked LM, seq2seq, sequence and token classification (``losses.py``).
        peft_config: a ``peft.PeftConfig`` (LoRA, prefix tuning, prompt tuning): the model is wrapped with
            ``get_peft_model`` and only the adapter is trained (TRL-style); or pass a ``PeftModel`` as ``model``.
        *args, **kwargs: passed to ``Trainer``. ``compute_loss_func`` is refused: its normalisation spans the batch.

    Under accelerate's FSDP plugin (FSDP2, flat clipping) the step is two-pass ghost clipping on the sharded model
    (``clipping/fsdp.py``); other clipping modes, user-level units, FSDP1 and DeepSpeed are refused.
    """

    def __init__(self, *args: Any, per_example_loss: PerExampleLoss | None = None, peft_config: Any = None,
                 **kwargs: Any):
        _check_compute_loss_not_overridden(type(self))  # before Trainer.__init__: a trl trainer's would fail first
        check_not_compiled(args[0] if args else kwargs.get("model"))  # before peft_config is applied to it
        self._peft_config = peft_config  # also applied to every model that model_init builds (call_model_init)
        if peft_config is not None:
            if args:
                args = (apply_peft_config(args[0], peft_config), *args[1:])
            elif kwargs.get("model") is not None:
                kwargs["model"] = apply_peft_config(kwargs.get("model"), peft_config)
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (target_epsilon or noise_multiplier, clipping, ...).")
        check_training_setup(self.args, compute_loss_func=self.compute_loss_func, train_dataset=self.train_dataset,
                             deepspeed=self.is_deepspeed_enabled, neftune_noise_alpha=self.neftune_noise_alpha)
        if self.is_fsdp_enabled:
            check_fsdp_supported(self.accelerator.state.fsdp_plugin, self.args)  # FSDP2, flat, example level
        elif fsdp_requested(self.args):
            msg = _fsdp_not_enabled_message(self.accelerator.distributed_type, self.args.world_size)
            warnings.warn(msg, UserWarning, stacklevel=2)
        self._custom_loss = user_loss_given(per_example_loss, self.args.label_smoothing_factor)  # (it wins: warned)
        self.per_example_loss = per_example_loss
        self.task = "custom"
        # σ, q, N, δ, the accountant, the noise and the budget (hf_dp/mechanism.py); N is read from the training set
        self.mechanism = Mechanism(self.args, lambda: self.train_dataset, lambda: self.args)
        self.mechanism.on_budget_stop = self._stop_for_budget
        self._grad_guard = StepGradientGuard()  # the release of each step, checked before the optimizer applies it
        self._state_guard = ReleasedStateGuard()  # nothing but the optimizer changes what is released (guarantee.py)
        self._realised_loss = RealisedLoss()  # the logged loss (clipping/step.py), kept across rebuilt strategies
        self._epoch_begun = False  # an epoch has begun in this training loop (_first_draw_of_epoch)
        self._secret_seed: int | None = None  # the model's secret DP seed, drawn once (see _run_seed)
        self._dp_step: DPStep | None = None
        self._fsdp: FSDPFlatClipping | None = None  # the DP step when it is FSDP2's
        self._build_clipping()
        self._start_history(self.model)  # a model already DP-trained: its earlier mechanisms compose (history.py)
        self._unit_detail = UnitDetail()  # what one privacy unit of the training set is (units.py)
        self.loss_is_scaled_for_ga = True  # our returned loss is already normalised; the Trainer must not rescale it
        self._dp_sampler: PoissonBatchSampler | ShuffledBatchSampler | None = None
        self.nonfinite_examples = 0  # examples with a non-finite loss or gradient norm, given clipping factor 0
        self._hyperparameter_trials = 0
        if not self.label_names:
            # DPTrainer reads `labels` from every batch; the Trainer keeps only the columns the model's forward
            # lists (plus label_names), and a forward taking **kwargs (Qwen3.5's classification head) lists none.
            self.label_names = ["labels"]
        if self.args.dp_adam_bias_correction:  # before any data is read: the optimizer must be Adam-family
            check_adam_bc_optim(self.args.optim, self.optimizer, self.lr_scheduler)
        self.add_callback(_DPCallback(self))
        self.callback_handler.callbacks.insert(0, _DPGradientCheck(self))
        self.add_callback(_DPHistoryCallback(self))
        if self.train_dataset is not None:
            self._validate_against_dataset()

    def _build_clipping(self) -> None:
        """The per-example machinery for ``self.model``: PEFT per-example prompts, the default per-example loss, the
        clipping engine and, for group-wise modes, the groups, and the DP step strategy that uses them — chosen here,
        once per model: FSDP2's two-pass ghost clipping (``clipping/fsdp.py``) when accelerate runs FSDP, else the
        book-keeping step (``clipping/local.py``). Called at construction and whenever the model or its trainable
        set changes (``model_init``, a parameter unfrozen before ``train()``)."""
        check_not_compiled(self.model)  # (model_init may return one)
        check_rows_are_examples(self.model)  # a head that folds each example into several rows, whatever the loss
        if self._dp_step is not None:  # a rebuild in train(); a frozen model may still be read (accountant, plan)
            check_something_trainable(self.model)
        per_example_prompts(self.model)
        check_adapter_objective(self.model)
        if not self._custom_loss:
            self.per_example_loss, self.task = self._default_loss(self.model)
        self._own_loss = None if self._custom_loss else self.per_example_loss  # the model's own on a batch of one
        fsdp = self.is_fsdp_enabled
        self._chunked = None if not self.args.lm_loss_chunk_size else ChunkedLMLoss(
            self.model, self.args.lm_loss_chunk_size, fsdp)
        with adapter_advice(self.model):
            # FSDP: built on the unwrapped model (accelerator.prepare wraps it in train()), hooks keyed by attribute.
            self.clipping_engine = FSDPClippingEngine(self.model) if fsdp else ClippingEngine(self.model)
        self.group_clipper: GroupClipper | None = None
        self.mechanism.set_clipping(None, self.clipping_engine)
        if self.args.clipping != "flat":
            self._setup_group_clipping()
        elif not fsdp:
            # Flat clipping: each layer's per-example norms are computed as its gradient arrives, keeping only what
            # its clipped sum needs (ClippingEngine.set_fused_groups with no handler); the sums follow the backward.
            groups = [g.params for g in build_groups(self.clipping_engine, "per_layer")]
            covered = {n for g in groups for n in g}
            rest = [n for n in self.clipping_engine.params if n not in covered]  # e.g. read outside any ruled layer
            self.clipping_engine.set_fused_groups(groups + ([rest] if rest else []), None)
        previous = self._dp_step
        self._dp_step = (FSDPFlatClipping if fsdp else LocalDPStep)(self._step_pieces())
        if previous is not None:  # the first-step checks run once per train(), not again for a rebuilt engine
            self._dp_step.self_checked = previous.self_checked
        self._fsdp = self._dp_step if fsdp else None

    def _step_pieces(self) -> StepPieces:
        """What the DP step gets (``clipping/step.py``): engine, group clipper, arguments, mechanism, hooks."""
        return StepPieces(engine=self.clipping_engine, group_clipper=self.group_clipper, args=self.args,
                          grad_guard=self._grad_guard, mechanism=self.mechanism, hooks=_StepHooks(self),
                          realised_loss=self._realised_loss)

    def _stop_for_budget(self) -> None:
        """The DP step released nothing (``Mechanism.stop_for_budget``): the training loop stops."""
        self.control.should_training_stop = True

    @property
    def _self_checked(self) -> bool:
        """Whether this run's first-step checks ran (kept by the DP step; ``train()`` re-arms them)."""
        return self._dp_step.self_checked

    @_self_checked.setter
    def _self_checked(self, value: bool) -> None:
        self._dp_step.self_checked = bool(value)

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """``Trainer.call_model_init``, plus ``peft_config`` applied to the new model and, when ``train()`` builds a
        new model (``model_init``, ``hyperparameter_search``), the clipping engine rebuilt for it: the engine built
        at construction hooks the previous model, whose per-example gradients the new one would escape."""
        model = super().call_model_init(trial)
        if getattr(self, "_peft_config", None) is not None:
            model = apply_peft_config(model, self._peft_config)
        if getattr(self, "clipping_engine", None) is not None:  # not the call inside Trainer.__init__
            if trial is not None:
                self._hyperparameter_trials += 1
            self.model = model
            self._build_clipping()
            logger.info("hf_dp: model_init built a new model; the clipping engine was rebuilt for it.")
            if not getattr(self, "_resumed", False):  # a fresh model: fresh history, unless it carries one
                self.accountant = self.mechanism.new_accountant()
                self._start_history(model)
                self.mechanism.steps_at_run_begin = self.accountant.steps
        return model

    def _validate_against_dataset(self) -> None:
        """Checks that need N: a non-empty training set, q <= 1 and δ < 1/N (each raises)."""
        if len(self.train_dataset) == 0:
            raise ValueError("The train_dataset is empty: DP training needs N >= 1 examples (q = B/N).")
        _ = self.sample_rate
        check_delta(self.target_delta, self.num_examples_private)
        self._check_privacy_unit()

    def _setup_group_clipping(self) -> None:
        """Groups, thresholds and (for per-layer modes) clipping fused into the backward pass (He et al. 2023)."""
        self.group_clipper = group_clipper_from_args(self.clipping_engine, self.args)  # clipping/modes.py
        groups = self.group_clipper.groups
        self.clipping_engine.set_fused_groups([g.params for g in groups], self.group_clipper.factors)
        self.mechanism.set_clipping(self.group_clipper, self.clipping_engine)
        if self.group_clipper.adaptive and self.noise_multiplier is not None:
            self._quantile_noise()  # fail now if σ_new is not real

    def _quantile_noise(self) -> tuple[float, float]:
        """``(σ_new, σ_b)`` for adaptive clipping (Prop. 3.1); ``(σ, 0)`` otherwise (``Mechanism.quantile_noise``)."""
        return self.mechanism.quantile_noise()

    # ------------------------------------------------------------------ quantities of the mechanism (mechanism.py)
    accountant = _mechanism_attribute("accountant", "The model's accountant (composes over all its DP runs).", True)
    noise_multiplier = _mechanism_attribute("noise_multiplier", "σ (None until calibrated at train start).", True)
    budget_exhausted = _mechanism_attribute("budget_exhausted", "A step was withheld: the budget is spent.", True)
    noise_allocation = _mechanism_attribute("noise_allocation", "How group-wise clipping splits the noise.")
    _noise = _mechanism_attribute("noise", "The run's noise generator (made with the train loader).")
    user_level = _mechanism_attribute("user_level", "``privacy_unit == 'user'``.")
    num_examples_private = _mechanism_attribute("num_units", "N: the privacy units of the training set.")
    expected_batch_size = _mechanism_attribute("expected_batch_size", "Per-device batch × accumulation × processes.")
    sample_rate = _mechanism_attribute("sample_rate", "q = expected batch size / N (N counts privacy units).")
    target_delta = _mechanism_attribute("delta", "δ: the argument, or ``1 / N^1.1`` (below 1/N).")
    steps_per_epoch = _mechanism_attribute("steps_per_epoch", "Logical steps per epoch: ``ceil(N / B)``.")
    noise_std = _mechanism_attribute("noise_std", "Std of the noise on the summed clipped gradient: σ · C (flat).")

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """The DP train loader: Poisson (or, opt-in, shuffled) batches, never padded or repeated by Accelerate."""
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        except ImportError:  # pragma: no cover
            pass
        noise = self.mechanism.new_noise(self._run_seed())  # secure_mode: noise.py
        self._dp_sampler = self.mechanism.batch_sampler(noise.seed)  # Poisson sampling of rate q (users, examples)
        # Deliberately not `accelerator.prepare`d: its even_batches/BatchSamplerShard would re-shard, pad or repeat
        # examples and break the sampling analysis (PITFALLS 2). Inputs are moved to the device in training_step.
        loader = dp_train_loader(dataset, collator, self._dp_sampler, self._check_batch_rows, self.args,
                                 self.mechanism.unit_ids() if self.user_level else None)
        if self._fsdp is not None:
            self._fsdp.dummy_source = loader  # FSDP: padding micro-batches (weight 0) are collated from it
        return loader

    def _check_batch_rows(self, num_examples: int, batch: dict) -> None:
        """Refuse a collated batch that does not hold one row per sampled example (``guarantee.check_batch_rows``:
        padding-free packing, a collator that drops or merges rows). Subclasses that clip packed rows per segment
        override this."""
        check_batch_rows(num_examples, batch)

    def _run_seed(self) -> int:
        """The seed of the Poisson draws and the noise: ``dp_seed``, or the model's secret seed, drawn once (shared by
        the ranks) and kept until a new model starts a new accountant (``model_init``). Together with the model's DP
        step count it fixes each step's draw (``sampling.py``): an attempt re-run by ``find_executable_batch_size``
        after running out of memory, or ``train()`` called again after an interruption, draws the aborted step
        again instead of choosing a new draw. It is never written to disk (a process restarted from a checkpoint
        draws a new one)."""
        if self.args.dp_seed is not None:
            return shared_seed(self.args.dp_seed)
        if self._secret_seed is None:
            self._secret_seed = shared_seed(None)
        return self._secret_seed

    def _first_draw_of_epoch(self, state) -> int:
        """At an epoch start: the DP step whose draw the epoch's first batch is. Every trained step is the draw of
        the step the accountant is at (DESIGN invariant 11): the model's DP step count, less the steps the Trainer
        skips at the start of the epoch when it resumes inside one (``Trainer._run_epoch``: ``global_step`` modulo
        the steps per epoch, unless ``ignore_data_skip``). :meth:`get_batch_samples` checks the result."""
        skipped = 0
        if self._resumed and not self._epoch_begun and not self.args.ignore_data_skip:
            skipped = state.global_step % self._dp_sampler.steps_per_epoch
        return max(self.accountant.steps - skipped, 0)

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """Fetch a step's chunks. ``num_items_in_batch`` is not computed: DP losses are per example.

        The Trainer calls this once per logical step, before any of its chunks runs: the DP step begins here
        (:meth:`DPStep.begin_step`: a step left half done is discarded, never added to this one) and its batch must
        be the draw of the DP step the accountant is at (checked exactly when the loader has no workers, which
        would draw ahead; with workers, a draw of an earlier step is refused)."""
        self._dp_step.begin_step()
        # before the draw, so that a changed q or chunk count is refused with its cause (not as a misaligned draw);
        # training_step begins it again at the first chunk, after on_step_begin, for the C the chunks clip with
        self.mechanism.begin_step(self._dp_sampler)
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        check_draw_is_current(self._dp_sampler, self.accountant.steps, self.args.dataloader_num_workers)  # sampling.py
        return batches, None

    def floating_point_ops(self, inputs: dict) -> int:
        return 0 if is_empty(inputs) else super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: dict, *args: Any, **kwargs: Any) -> None:
        """``include_num_input_tokens_seen``: an empty Poisson chunk holds no tokens. It still takes part in the
        Trainer's gather of the count (a rank that skipped it would leave the others waiting in the collective) and
        does not reach the Trainer's warning about a model without ``main_input_name``."""
        if not is_empty(inputs):
            return super()._track_num_input_tokens(inputs, *args, **kwargs)
        if self.args.include_num_input_tokens_seen in ("no", False, None):
            return None
        zero = torch.zeros((), device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(zero).sum().item()
        return None

    # ------------------------------------------------------------------ the DP step's hooks (clipping/step.py)
    _slice_batch = staticmethod(slice_batch)

    def _micro_batches(self, inputs: dict, labels: torch.Tensor,
                       units: torch.Tensor | None = None) -> list[tuple[dict, torch.Tensor, torch.Tensor | None]]:
        """Split a chunk into micro-batches of at most ``per_device_train_batch_size`` examples (memory only).

        With user-level units, a user's examples (contiguous in the chunk) are never split: a micro-batch holds whole
        users, and a user with more examples than the bound gets a micro-batch of their own.
        """
        batch = labels.shape[0]
        bounds = micro_batch_bounds(batch, max(1, self._train_batch_size or self.args.per_device_train_batch_size),
                                    units)
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sl = slice(a, b)
            out.append((self._slice_batch(inputs, sl, batch), labels[sl], None if units is None else units[sl]))
        return out

    def _self_check(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """Once per run, before the first update (the DP step's first-step hook): the engine's checks on the real
        model and data (:meth:`_first_step_checks`) and each example against itself alone. Subclasses extend it
        (``DPSFTTrainer`` checks packed rows)."""
        self._check_loss_is_the_models_own(net, micro, labels)
        self._first_step_checks(net, micro, labels)
        self._check_examples_alone(net, micro, labels)

    def _first_step_checks(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """The engine's first-step checks (batch axes, hooks vs autograd, ``dp_self_check``) on a micro-batch
        (:func:`hf_dp.clipping.local.first_step_check`)."""
        first_step_check(self.clipping_engine, _StepHooks(self), self.args, net, micro, labels)

    def _check_batch(self) -> tuple[dict, torch.Tensor] | None:
        """The first two training examples, collated and on the device (for the first-step checks)."""
        loader = getattr(self.callback_handler, "train_dataloader", None)
        if loader is None or len(loader.dataset) < 2:
            return None
        return collated_on_device(_StepHooks(self), loader.collate_fn([loader.dataset[0], loader.dataset[1]]))

    def _segment_ids(self, inputs: dict) -> torch.Tensor | None:
        """``(rows, T)``: the example each token of a padding-free packed micro-batch belongs to (``DPSFTTrainer``);
        ``None`` when every row is one example."""
        return None

    def _model_inputs(self, model, inputs: dict, labels: torch.Tensor) -> dict:
        """The model's inputs for a micro-batch: a copy of ``inputs``; for encoder-decoder LMs (default or custom
        ``per_example_loss``) with the decoder inputs built from ``labels`` (``losses.seq2seq_model_inputs``)."""
        seq2seq = getattr(self, "_seq2seq_lm", None)
        if seq2seq is None:
            seq2seq = self._seq2seq_lm = is_seq2seq_lm(model)
        return seq2seq_model_inputs(model, inputs, labels) if seq2seq else dict(inputs)

    def _example_losses(self, net: torch.nn.Module, inputs: dict, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Each example's own loss on a micro-batch (``clipping.step.StepHooks.example_losses``)."""
        if self._chunked is None:
            return self.per_example_loss(net(**self._model_inputs(net, inputs, labels)), labels, **kwargs)
        recorder = self.clipping_engine.recorder
        return self._chunked(net, self._model_inputs(net, inputs, labels), labels, self.per_example_loss,
                             on_output=recorder.backward_starts_at, window=recorder.positions, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """One chunk of a logical DP step, run by the step strategy chosen in :meth:`_build_clipping`: clip each
        example's gradient and add it to the step's sum; at the step's last chunk, privatize (``clipping/step.py``).

        Without FSDP, first the trainable set is checked (at a step boundary the engine is rebuilt for a changed
        set, which also rebuilds the strategy) and, at a step's first chunk, gradients computed outside the DP step
        are discarded (``guarantee.py``)."""
        self._chunk_indices = inputs.pop(INDEX_KEY, None)  # the rows' dataset indices (counterfactual check)
        if self._fsdp is None:
            at_boundary = self._dp_step.at_step_boundary
            try:
                self._sync_trainable_set(at_step_boundary=at_boundary)
            except BaseException as err:  # a refusal in the middle of a step: the step is discarded as it escapes
                self._dp_step.discard_step(f"{type(err).__name__} escaped the DP step")
                raise
            if at_boundary:
                self.mechanism.begin_step(self._dp_sampler)  # C of the step's chunks; q as drawn
                self._discard_stale_gradients()
                self._state_guard.begin_step()  # nothing changed since the last optimizer step
        elif self._dp_step.at_step_boundary:
            self.mechanism.begin_step(self._dp_sampler)  # FSDP too: C of the step's chunks; q as drawn
        try:
            return self._dp_step.run_chunk(model, None if is_empty(inputs) else inputs)
        except Exception as err:
            self._state_guard.explain(err)  # a tensor written inside the step is the cause, if there is one
            raise

    # ------------------------------------------------------------------ accounting
    def _dp_on_train_begin(self, state, train_dataloader: Any = None) -> None:
        check_train_loader(train_dataloader, self._dp_sampler)  # a subclass's loader must not bypass Poisson sampling
        if self._chunked is not None:
            self._chunked.check_loss(self.per_example_loss)
        self._check_known_dependences(train_dataloader)  # refused before training: see hf_dp/counterfactual.py
        if getattr(self, "_trial", None) is not None and self._fsdp is None:
            # hyperparameter_search set this trial's arguments after call_model_init built the engine.
            self._build_clipping()
            if not self._resumed:
                self.noise_multiplier = self.args.noise_multiplier
        if _distributed() and self._fsdp is None:  # under FSDP every coordinate lives on one rank only
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)
        remaining = max(state.max_steps - state.global_step, 0)
        if self._resumed and self.accountant.steps < state.global_step:
            raise RuntimeError(
                f"The accountant has {self.accountant.steps} steps but the Trainer is at step {state.global_step}: "
                "resume from a checkpoint written by DPTrainer (it holds dp_state.json)."
            )
        self.mechanism.begin_run(remaining)  # σ calibrated (target_epsilon) and checked; the steps the budget allows
        if any(isinstance(cb, EarlyStoppingCallback) for cb in self.callback_handler.callbacks):
            warnings.warn("EarlyStoppingCallback stops training by evaluation metrics. If the evaluation set is "
                          "private data, that choice is not covered by the DP guarantee.", NotPrivateWarning,
                          stacklevel=2)
        if not self.args.poisson_sampling:
            logger.warning("hf_dp: shuffled fixed-size batches: the reported ε assumes Poisson sampling and is "
                           "heuristic for this run.")
        self._log_privacy_plan(remaining)

    # ------------------------------------------------------------------ run-time guarantee checks (guarantee.py)
    def _sync_trainable_set(self, at_step_boundary: bool, at_train_begin: bool = False) -> None:
        """The engine must clip exactly the model's trainable parameters (by identity).

        A parameter unfrozen, frozen or replaced since the engine was built: at train start, and at a step boundary
        for flat clipping, the engine is rebuilt (and the log says so); otherwise the change is refused
        (``guarantee.check_trainable_set_change``).
        """
        sharded = self._fsdp is not None
        added, removed = trainable_set_difference(self.model, self.clipping_engine.params, by_name=sharded)
        if not added and not removed:
            return
        what = describe_difference(added, removed)
        check_trainable_set_change(what, sharded=sharded, at_step_boundary=at_step_boundary,
                                   at_train_begin=at_train_begin,
                                   group_clipping=self.args.clipping if self.group_clipper is not None else None)
        logger.warning("hf_dp: the trainable parameters changed %s (%s); the clipping engine was rebuilt so that "
                       "every trainable parameter is clipped per example.",
                       "before train()" if at_train_begin else "during training", what)
        self._build_clipping()

    def _discard_stale_gradients(self) -> None:
        """Gradients computed outside the DP step are dropped at a step's first chunk
        (``guarantee.discard_stale_gradients``); the first time, the log says so."""
        stale = discard_stale_gradients(self.model)
        if stale and not getattr(self, "_warned_stale", False):
            logger.warning("hf_dp: %d parameter(s) held a gradient computed outside the DP step (e.g. by a "
                           "callback's backward); it is discarded: only the DP release reaches the optimizer.", stale)
            self._warned_stale = True

    def _check_step_gradients(self) -> None:
        """Before the optimizer step: the gradients are this step's DP release and nothing else."""
        if self._fsdp is not None:
            return  # FSDP2: pass 2 is a plain backward of Σ c_i L_i; clipping/fsdp.py checks it against the hooks
        # With max_grad_norm > 0 the Trainer rescales every gradient in place once before this point (clip_grad_norm_:
        # post-processing of the released gradient). Its norm-only pass is off (_get_grad_norm), so otherwise none.
        check_step_gradients(self._grad_guard, self.model, self.clipping_engine.params,
                             allowed_version_bumps=1 if self.args.max_grad_norm > 0 else 0, optimizer=self.optimizer)

    def _start_state_guard(self) -> None:
        """At train start: from here on only the optimizer applying the DP release changes the model's parameters and
        buffers and the optimizer's tensors (``guarantee.ReleasedStateGuard``). Not under FSDP2, whose sharded
        parameters are swapped by FSDP itself around every forward and backward (README)."""
        if self._fsdp is None:
            self._state_guard.start(self.model, self.optimizer)

    def _load_best_model(self, *args: Any, **kwargs: Any) -> Any:
        """``load_best_model_at_end``: the run's releases end here (the choice is named in ``dp_guarantee``); what
        changed before it is checked first."""
        self._state_guard.check("train_end")
        self._state_guard.stop()
        return super()._load_best_model(*args, **kwargs)

    def _report_nonfinite(self, step: int) -> None:
        """Warn about (and log as ``nonfinite_examples``) examples of the last step with a non-finite loss or norm."""
        count = self._dp_step.pop_nonfinite()
        if not count:
            return
        self.nonfinite_examples += count
        logger.warning(nonfinite_message(step, count, self.nonfinite_examples))
        self.log({"nonfinite_examples": count})

    def _budget_allows(self, n: int) -> bool:
        return self.mechanism.budget_allows(n)

    def dp_guarantee_notes(self) -> list[str]:
        """Why the run's guarantee is not the strict (ε, δ)-DP that the accountant reports, if it is not.

        Collects the trainer's own reasons and those of every callback that has a ``dp_guarantee_notes()`` method
        (flatness regularisers, audits, ...). An empty list means the guarantee is strict.
        """
        early_stopping = any(isinstance(cb, EarlyStoppingCallback) for cb in self.callback_handler.callbacks)
        notes = setting_notes(self.mechanism.recorded_args(), self.noise_multiplier, early_stopping,  # guarantee.py
                              bool(self._hyperparameter_trials or getattr(self, "hp_search_backend", None) is not None))
        notes.extend(self._history.notes(str(self.args.privacy_unit or "example"),
                                         self.args.user_id_column if self.user_level else None))
        notes.extend(release_notes(self))  # uploads that cannot be redacted (release.py)
        for cb in self.callback_handler.callbacks:
            extra = getattr(cb, "dp_guarantee_notes", None)
            if callable(extra):
                notes.extend(extra())
        return notes

    @property
    def dp_guarantee(self) -> str:
        """``"strict"``, or ``"not strict: <reasons>"`` (see :meth:`dp_guarantee_notes`)."""
        notes = self.dp_guarantee_notes()
        return "strict" if not notes else "not strict: " + "; ".join(notes)

    # ------------------------------------------------------------------ DP-AdamBC (hf_dp/optim.py)
    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """``Trainer.create_optimizer``; with ``dp_adam_bias_correction`` the Adam-family optimizer becomes
        :class:`~hf_dp.optim.DPAdamBC` (Tang et al. 2024), reading the noise std of each released gradient live."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.args.dp_adam_bias_correction:
            self.optimizer = optimizer = bias_corrected_adam(optimizer, self.mechanism.released_noise_std,
                                                             self.args.dp_adam_bc_epsilon)
        return optimizer

    # ------------------------------------------------------------------ the plan (before train()) and its banner
    def planned_max_steps(self) -> int:
        """The ``state.max_steps`` that a fresh ``train()`` will run: ``Trainer.set_initial_training_values`` itself,
        applied to the length of the DP loader (``steps_per_epoch × gradient_accumulation_steps`` chunks)."""

        class _Sized:  # what set_initial_training_values reads of the loader: its length
            def __len__(_self) -> int:
                return self.steps_per_epoch * self.args.gradient_accumulation_steps

        return int(self.set_initial_training_values(self.args, _Sized())[-1])

    def privacy_plan(self, max_steps: int | None = None) -> dict[str, Any]:
        """The privacy plan of a fresh ``train()``, without training: the numbers the run will use and log.

        σ is calibrated exactly as ``train()`` will calibrate it (``Mechanism.calibrate`` for
        :meth:`planned_max_steps` steps), or taken from ``noise_multiplier`` (then ``epsilon`` is what the whole run
        will spend). ``noise_to_signal`` is the expected norm of the noise on one averaged update, ``σ·C·√d / (q·N)``
        for ``d`` trainable parameters, over the largest possible norm of the averaged clipped gradient, ``C`` (all
        examples pointing the same way); ``noise_to_signal_over_run`` is the same for the sum of the run's ``T``
        updates (noise grows as √T, signal at most as T): ``noise_to_signal / √T``. Above
        :data:`NOISE_TO_SIGNAL_WARNING` the noise dominates, and the plan says so (``noise_dominates``,
        ``advice``; ``train()`` warns) — see the README's "Choosing hyperparameters".

        Args:
            max_steps: Steps to plan for (default: :meth:`planned_max_steps`, what ``train()`` runs).
        """
        steps = self.planned_max_steps() if max_steps is None else int(max_steps)
        return self.mechanism.plan(  # hf_dp/plan.py: the same function as `hf-dp plan`
            steps, sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            history=self._history.earlier_mechanisms())  # a model already DP-trained continues from its history

    def _log_privacy_plan(self, remaining: int) -> None:
        """At train start: the budget as one block through the Trainer's own logging (console, ``log_history``,
        TensorBoard/W&B), visible without any logging set-up; the advice of :meth:`privacy_plan` as a warning
        (``Mechanism.plan_log``: the plan's maths, ``plan.py``)."""
        d = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        block, advice = self.mechanism.plan_log(remaining, d, self._history.earlier_steps if self._history.earlier
                                                else None)
        self.log(block)
        if advice is not None:
            warnings.warn(advice, UserWarning, stacklevel=2)

    def privacy_record(self, accountant: PrivacyAccountant | None = None,
                       noise_multiplier: float | None = None) -> PrivacyRecord:
        """The run's :class:`~hf_dp.record.PrivacyRecord`: a snapshot of the run's description (δ, σ, q, N, C,
        clipping, unit, sampling, accountant, noise source, trained parameters, optimizer, base model, guarantee
        notes, audits) holding the live accountant, ``self.accountant`` itself (``accountant`` / ``noise_multiplier``
        describe a planned run instead, :meth:`privacy_plan`). The logs, :meth:`privacy_spent`, ``dp_state.json``,
        the model card, the dataset card of synthetic data and the audit reports all read it.

        Before ``train()``, σ is the one the run will use (calibrated as ``train()`` will, :meth:`privacy_plan`).
        """
        acc = self.accountant if accountant is None else accountant
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if sigma is None and self.train_dataset is not None:
            sigma = self.mechanism.calibrate(self.planned_max_steps(), acc.history)
        model = self._unwrapped_model()
        return PrivacyRecord(
            accountant=acc,
            **self.mechanism.record_fields(sigma),
            trained_parameters=describe_trained_parameters(model, getattr(self.clipping_engine, "params", None)),
            optimizer=describe_optimizer(self.optimizer, self.args.optim),
            base_model=model_base_model(model),
            dp_guarantee=self.dp_guarantee,
            load_best_model_at_end=bool(self.args.load_best_model_at_end),
            budget_exhausted=bool(self.budget_exhausted),
            eval_data_is_public=bool(self.args.eval_data_is_public),
            audit=plain(audit_report(self)) or None,
            run_id=self._history.run_id if accountant is None else None,
            earlier_runs=plain(self._history.earlier) or None,
            privacy_unit_detail=self._privacy_unit_detail(),
            prv_accountant_version=acc.state_dict().get("prv_accountant_version"),
        )

    def _unwrapped_model(self) -> torch.nn.Module:
        try:
            return self.accelerator.unwrap_model(self.model)
        except Exception:  # noqa: BLE001 - unwrap only fails for exotic wrappers
            return self.model

    def privacy_spent(self, delta: float | None = None) -> dict[str, Any]:
        """The guarantee so far: ε at δ (configured accountant; PRV upper bound by default) and the mechanism
        (:meth:`PrivacyRecord.spent <hf_dp.record.PrivacyRecord.spent>` of :meth:`privacy_record`).

        ``accountant_used`` names the accountant that produced ``epsilon`` (``"pld (prv-accountant failed
        numerically)"`` where prv-accountant fails). Before ``train()``, ``noise_multiplier`` is the σ the run will
        use (calibrated as ``train()`` will, :meth:`privacy_plan`).
        """
        return self.privacy_record().spent(delta)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds ``epsilon`` (spent so far) and ``delta`` to every training log, next to the loss; at the end of
        training (the Trainer's ``train_runtime`` log) also the steps taken and the accountant that computed ε
        (:meth:`PrivacyRecord.log_fields <hf_dp.record.PrivacyRecord.log_fields>`).

        A ``grad_norm`` entry (the Trainer's norm of the already-noised update, not a clipping statistic) is dropped;
        ``DPTrainer`` does not compute it (:meth:`_get_grad_norm`).

        The training ``loss`` (and the final ``train_loss``) is the realised mean of the per-example losses over the
        examples sampled in the steps released since the last log (over the run), summed over the ranks
        (:class:`~hf_dp.clipping.step.RealisedLoss`): not divided by the expected batch, so it does not jump with the
        realised batch size, and an empty step, having no loss, does not pull it down (a window of empty steps logs
        no ``loss``). Like the plain Trainer's, it is computed from the private data without noise: it is not covered
        by the DP guarantee (the card omits it; pushed training records are redacted).
        """
        if "train_runtime" in logs and "train_loss" in logs:  # the dict train() returns as TrainOutput.metrics
            mean = self._realised_loss.run_mean()
            logs["train_loss"] = float("nan") if mean is None else mean
        # ``logs`` is changed in place, as the Trainer's own ``log`` does: ``evaluate()`` returns the dict it logged,
        # and a subclass's ``log`` (trl's) adds its metrics to the same dict.
        if "loss" in logs and getattr(self, "_logging_train_loss", False):
            mean = self._realised_loss.pop_window()
            rest = {k: v for k, v in logs.items() if k != "loss"}
            logs.clear()
            if mean is not None:  # a window of empty steps only has no loss (the key is left out)
                logs["loss"] = mean
            logs.update(rest)
        logs.pop("grad_norm", None)
        if self.accountant.steps > 0 and self.train_dataset is not None:
            logs.update(self.privacy_record().log_fields(final="train_runtime" in logs))
            if self.group_clipper is not None:
                logs.update(self.mechanism.group_logs())
        super().log(logs, *args, **kwargs)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        """Not computed: after the DP step ``.grad`` holds the noised update, whose norm (≈ σ·C·√d / (q·N), mostly
        noise) the Trainer would log as ``grad_norm`` next to the loss, where it reads like a clipping statistic.
        The per-example clipping threshold is ``per_sample_max_grad_norm``."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; on resume, also restores the accountant so that ε continues exactly.

        Privacy accounting follows the model: a second ``train()`` on the same model (without resume) continues the
        accountant, so ε composes over both runs (with ``target_epsilon``, σ is calibrated to the budget that is
        left, and the run is refused if none is). Only a new model starts a fresh accountant: ``model_init`` (which
        builds one for every ``train()``), or a new ``DPTrainer`` on a fresh model. A model an earlier ``DPTrainer``
        trained carries its history (``hf_dp/history.py``): this trainer's accountant starts from it, and at every
        ``train()`` it is re-read (another trainer may have trained the model since).
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._resumed = bool(resume_from_checkpoint)
        self._dp_sampler = None  # set by get_train_dataloader; checked at train start (a subclass may bypass it)
        self._grad_guard.reset()
        self._dp_step.reset()  # a half-done logical step of an earlier run is dropped
        if self.model_init is None:
            self._sync_trainable_set(at_step_boundary=True, at_train_begin=True)  # (model_init: call_model_init)
            check_something_trainable(self.model)
        if resume_from_checkpoint:
            self._load_dp_state(resume_from_checkpoint)
        elif self.model_init is not None:
            self.accountant = self.mechanism.new_accountant()  # a new model is built in train()
            self._secret_seed = None  # ... with a history of its own (_run_seed)
            self.noise_multiplier = self.args.noise_multiplier
        else:
            # Another trainer may have trained this model since this one was built: continue from all it carries.
            self.accountant.history = self._history.refresh(self._unwrapped_model(), self.accountant.history)
            if self.accountant.steps > self._history.earlier_steps:
                msg = (f"hf_dp: train() again on the same model, which already took {self.accountant.steps} DP "
                       "steps: privacy accounting continues, ε composes over all runs"
                       + (" and σ is calibrated to the budget that is left." if self.args.target_epsilon is not None
                          else "."))
                warnings.warn(msg, UserWarning, stacklevel=2)
            self.noise_multiplier = self.args.noise_multiplier  # None with target_epsilon: calibrated at train start
        self.mechanism.steps_at_run_begin = self.accountant.steps
        self.budget_exhausted = False
        self._self_checked = False
        if self.train_dataset is not None:
            self._validate_against_dataset()
        if resume_from_checkpoint and self.args.target_epsilon is not None and self.noise_multiplier is not None:
            if self.mechanism.epsilon_after(1) > self.args.target_epsilon:
                logger.warning(
                    "hf_dp: not resuming training: the privacy budget ε=%s (δ=%.3g) is spent (ε=%.4f after %d steps) "
                    "and one more step would exceed it.",
                    self.args.target_epsilon, self.target_delta, self.accountant.get_epsilon(self.target_delta),
                    self.accountant.steps,
                )
                self.budget_exhausted = True
                # The model the accountant describes is the checkpoint's (as the plain Trainer resuming a finished
                # run leaves it), not the one this trainer was built with, which save_model() would release as such.
                self._load_from_checkpoint(resume_from_checkpoint)
                return TrainOutput(self.accountant.steps, float("nan"), {"epsilon": self.privacy_record().epsilon()})
        try:
            output = super().train(resume_from_checkpoint or None, *args, **kwargs)
        finally:
            self._state_guard.stop()  # the run's releases are over (also when train() raised)
        return self._with_realised_train_loss(output)

    def _with_realised_train_loss(self, output: TrainOutput) -> TrainOutput:
        """``TrainOutput.training_loss`` as logged: the realised mean loss of the run's released steps (NaN when
        no example was sampled; :class:`~hf_dp.clipping.step.RealisedLoss`)."""
        mean = self._realised_loss.run_mean()
        return output._replace(training_loss=float("nan") if mean is None else mean)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer._maybe_log_save_evaluate``; the training loss it logs is replaced in :meth:`log`."""
        self._logging_train_loss = True
        try:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        finally:
            self._logging_train_loss = False

    def _dp_state(self) -> dict[str, Any]:
        """The content of ``dp_state.json``: :meth:`privacy_record` as a dict."""
        return self.privacy_record().to_dict()

    def card_inputs(self, tags: Any = None) -> dict[str, Any]:
        """What a model card needs besides the record, gathered here as plain data (``hf_dp.cards`` never reads a
        trainer; ``release.card_inputs``): the tags (``tags`` and the model's own, e.g. trl's), the training
        hyperparameters, the latest evaluation metrics (published only when the evaluation data is declared public)
        and the task."""
        hyperparameters = card_hyperparameters(self.args, self.optimizer, self.expected_batch_size,
                                               self.accountant.steps)
        return card_inputs(tags, getattr(self._unwrapped_model(), "model_tags", None), hyperparameters,
                           getattr(self.state, "log_history", None), self.task)

    def _write_model_card(self, output_dir: str, record: PrivacyRecord | None = None, **kwargs: Any) -> Any:
        """``release.write_model_card`` with this run's record and :meth:`card_inputs`, on the processes that save
        (the card is written next to the weights)."""
        if not self.args.should_save:
            return None
        record = self.privacy_record() if record is None else record
        return write_model_card(record, output_dir, self.card_inputs(kwargs.pop("tags", None)), **kwargs)

    def save_model(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> None:
        """``Trainer.save_model``, plus the privacy state (``dp_state.json``) next to the weights.

        ``Trainer._save_checkpoint`` saves through this method, so every checkpoint holds the accountant's state.
        ``dp_state.json`` and the card are written from the same :meth:`privacy_record`. During ``train()``, the
        model saved must be the one the last optimizer step left (``guarantee.ReleasedStateGuard``).
        """
        self._state_guard.check("before_save")
        super().save_model(output_dir, *args, **kwargs)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.accountant.steps > 0 and os.path.isdir(output_dir):
            record = self.privacy_record()
            record.save(os.path.join(output_dir, DP_STATE_NAME))
            # Every checkpoint and the final output carry a card with the privacy metadata (cards.py).
            self._write_model_card(output_dir, record, model_name=os.path.basename(os.path.normpath(
                self.args.output_dir)))

    def create_model_card(self, language: str | None = None, license: str | None = None, tags: Any = None,
                          model_name: str | None = None, finetuned_from: str | None = None, tasks: Any = None,
                          dataset_tags: Any = None, dataset: Any = None, dataset_args: Any = None,
                          **kwargs: Any) -> Any:
        """The model card with a ``differential_privacy`` record (``hf_dp/cards.py``), also what ``push_to_hub``
        uploads. Same signature as ``Trainer.create_model_card``, plus ``output_dir`` (default: ``args.output_dir``)
        and the keywords of :func:`hf_dp.cards.render_model_card` (``dataset_name``, ``eval_results``, ...).
        Returns the card written (None before the first DP step and on processes that do not save)."""
        if self.accountant.steps == 0:
            return None
        output_dir = kwargs.pop("output_dir", None) or self.args.output_dir
        return self._write_model_card(output_dir, model_name=model_name, tags=tags, language=language,
                                      license=license, finetuned_from=finetuned_from, tasks=tasks, dataset=dataset,
                                      **kwargs)

    def _push_from_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer._push_from_checkpoint`` (``push_to_hub`` with ``hub_strategy`` ``"every_save"``,
        ``"checkpoint"``, ``"all_checkpoints"``), uploading the checkpoint's privacy card and ``dp_state.json`` with its
        weights, and redacted training records (``release.checkpoint_push``). The conditions under which the Trainer
        skips the push are mirrored, so ``output_dir`` never gets a card newer than its weights."""
        from transformers.trainer_utils import HubStrategy

        checkpoint_folder = str(args[0] if args else kwargs.pop("checkpoint_folder"))
        args = args[1:]
        pushing = getattr(self, "push_in_progress", None)  # set by init_hf_repo on the main process only
        idle = pushing is None or pushing.is_done()
        will_push = (self.is_world_process_zero() and self.args.hub_strategy != HubStrategy.END
                     and (self.args.hub_always_push or idle))
        if not will_push:
            return super()._push_from_checkpoint(checkpoint_folder, *args, **kwargs)
        output_dir = self.args.output_dir
        staged = checkpoint_push(
            checkpoint_folder, output_dir, self.accountant.steps, eval_public=self.args.eval_data_is_public,
            clean=idle, rewrite_card=lambda: self._write_model_card(
                output_dir, model_name=os.path.basename(os.path.normpath(output_dir))))
        return super()._push_from_checkpoint(str(staged), *args, **kwargs)

    def push_to_hub(self, *args: Any, **kwargs: Any):
        """``Trainer.push_to_hub`` with redacted training records: ``trainer_state.json`` and ``*results.json`` in
        ``output_dir`` (written by ``save_state()`` / ``save_metrics()``) are uploaded without the training loss,
        flos, token counts, audit results and (unless ``eval_data_is_public``) evaluation metrics; the originals
        stay in ``output_dir/_hf_dp_private/`` (``hf_dp/release.py``). ``kwargs`` go to :meth:`create_model_card`
        as with ``Trainer``."""
        if self.is_world_process_zero() and os.path.isdir(self.args.output_dir):
            redact_output_dir(self.args.output_dir, self.args.eval_data_is_public)
        result = super().push_to_hub(*args, **kwargs)
        pushing = getattr(self, "push_in_progress", None)
        if self.is_world_process_zero() and (pushing is None or pushing.is_done()):
            shutil.rmtree(os.path.join(self.args.output_dir, STAGING_DIR), ignore_errors=True)
        return result

    def _load_dp_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, DP_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {DP_STATE_NAME}: the privacy spent before it is unknown, so resuming would "
                "under-count ε. Resume only from checkpoints written by DPTrainer."
            )
        record = PrivacyRecord.load(path)
        # The same run, continued: its id and the earlier runs it continued from (history.py) are the checkpoint's.
        history = ModelHistory(record.earlier_runs or [], run_id=record.run_id)
        history.own_mechanisms(record.accountant.history)  # fails loudly if they do not add up
        self._history = history
        self.mechanism.resume_from(record)  # the accountant (ε continues), σ, the clipping thresholds
