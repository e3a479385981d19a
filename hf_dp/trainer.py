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
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from .accounting import PrivacyAccountant, calibrate_noise_multiplier, split_noise_for_quantiles
from .arguments import DPTrainingArguments, NotPrivateWarning
from .cards import create_model_card
from .clipping.engine import ClippingEngine
from .clipping.fsdp import FSDPFlatClipping, check_fsdp_supported, fsdp_requested
from .clipping.modes import GroupClipper, build_groups, flat_clip_factors
from .losses import PerExampleLoss, default_per_example_loss
from .noise import NoiseGenerator, group_noise_stds, privatize
from .peft_support import apply_peft_config, per_example_prompts
from .sampling import PoissonBatchSampler, PoissonUserSampler, ShuffledBatchSampler

__all__ = ["DPTrainer", "DP_STATE_NAME"]

logger = logging.getLogger(__name__)

DP_STATE_NAME = "dp_state.json"
_EMPTY = "_hf_dp_empty_batch"
_COUNTS = "_hf_dp_clip_counts"
_UNIT = "_hf_dp_unit"


class _EmptySafeCollator:
    """Wraps the data collator: an empty Poisson chunk becomes a marker batch instead of a collator error, and the
    privacy-unit ids that :class:`_UnitTaggedDataset` attaches are collated into one tensor."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features: list) -> dict:
        if len(features) == 0:
            return {_EMPTY: True}
        if isinstance(features[0], dict) and _UNIT in features[0]:
            units = torch.tensor([f[_UNIT] for f in features], dtype=torch.long)
            batch = self.collator([{k: v for k, v in f.items() if k != _UNIT} for f in features])
            batch[_UNIT] = units
            return batch
        return self.collator(features)


class _UnitTaggedDataset(torch.utils.data.Dataset):
    """The training set, each row tagged with its privacy unit (user) id for user-level clipping."""

    def __init__(self, dataset, unit_of_example):
        self.dataset = dataset
        self.unit_of_example = unit_of_example

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], _UNIT: int(self.unit_of_example[i])}


def _is_empty(inputs: dict) -> bool:
    return bool(inputs.get(_EMPTY, False))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _DPCallback(TrainerCallback):
    """The DPTrainer's own hooks into the loop: calibration at train start, sampler epochs, budget stops."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._dp_on_train_begin(state)

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self.trainer._dp_sampler
        if sampler is not None:
            sampler.set_epoch(state.global_step // sampler.steps_per_epoch)

    def on_step_end(self, args, state, control, **kwargs):
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


class DPTrainer(Trainer):
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
        if peft_config is not None:
            if args:
                args = (apply_peft_config(args[0], peft_config), *args[1:])
            else:
                kwargs["model"] = apply_peft_config(kwargs.get("model"), peft_config)
        super().__init__(*args, **kwargs)
        per_example_prompts(self.model)
        if not isinstance(self.args, DPTrainingArguments):
            raise TypeError("DPTrainer needs DPTrainingArguments (target_epsilon or noise_multiplier, clipping, ...).")
        if self.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func normalises the loss over the batch, which breaks per-example clipping. Pass "
                "per_example_loss=fn with fn(outputs, labels) -> one loss per example instead."
            )
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError("DP training needs a map-style train_dataset of known size N (Poisson sampling, q = B/N).")
        if self.is_deepspeed_enabled:
            raise ValueError(
                "DPTrainer does not support DeepSpeed sharding: the per-example hooks need whole parameters on each "
                "rank. Use multi-process DDP (`accelerate launch --multi_gpu`), FSDP2 with clipping='flat', and for "
                "models placed across devices, clipping='per_device'."
            )
        if self.is_fsdp_enabled:
            check_fsdp_supported(self)  # FSDP2, flat clipping, example level (clipping/fsdp.py)
        elif fsdp_requested(self.args):
            self._warn_fsdp_not_enabled()
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.args.world_size != launched:
            raise ValueError(
                f"{launched} processes were launched (WORLD_SIZE={launched}) but the Trainer runs them as "
                f"{self.args.world_size} independent process(es) (parallel_mode={self.args.parallel_mode.value}): each "
                "would train on all the data with its own noise, and every extra model released spends the privacy "
                "budget again. On CPU-only machines launch with `accelerate launch --multi_gpu --num_processes N` "
                "(gloo) or pass use_cpu=True / `--use_cpu` so transformers sets up distributed training."
            )
        if self.neftune_noise_alpha is not None:
            raise ValueError("NEFTune adds data-dependent noise outside the DP mechanism; unsupported with DPTrainer.")
        if per_example_loss is None:
            per_example_loss, self.task = default_per_example_loss(self.model)
        else:
            self.task = "custom"
        self.per_example_loss = per_example_loss
        self._fsdp: FSDPFlatClipping | None = None
        if self.is_fsdp_enabled:
            # Built on the unwrapped model (accelerator.prepare wraps it in train()); two-pass ghost clipping.
            self._fsdp = FSDPFlatClipping(self)
            self.clipping_engine = self._fsdp.engine
        else:
            self.clipping_engine = ClippingEngine(self.model)
        self.noise_multiplier: float | None = self.args.noise_multiplier
        self.group_clipper: GroupClipper | None = None
        self.noise_allocation = self.args.noise_allocation or (
            "equal_budget" if self.args.clipping == "per_device" else "global")
        if self.args.clipping != "flat":
            self._setup_group_clipping()
        self.accountant = PrivacyAccountant(accountant=self.args.accountant)
        self.budget_exhausted = False
        self.loss_is_scaled_for_ga = True  # our returned loss is already normalised; the Trainer must not rescale it
        self._dp_sampler: PoissonBatchSampler | ShuffledBatchSampler | None = None
        self._noise: NoiseGenerator | None = None
        self._allowed_steps: int | None = None
        self.add_callback(_DPCallback(self))
        if self.train_dataset is not None:
            self._validate_against_dataset()

    def _warn_fsdp_not_enabled(self) -> None:
        """FSDP was asked for but accelerate did not enable it: say loudly that DDP (or one process) runs instead."""
        msg = (
            "hf_dp: FSDP was requested (TrainingArguments fsdp=... or `accelerate launch --use_fsdp`) but accelerate "
            f"did not enable it (distributed_type={self.accelerator.distributed_type}): this run is "
            + ("multi-process DDP, every rank holding the whole model" if self.args.world_size > 1
               else "a single process") + ". accelerate switches to FSDP only for processes on accelerators "
            "(accelerate/state.py, AcceleratorState.__init__: DistributedType.FSDP is set only when the type is "
            "MULTI_GPU/MULTI_XPU/MULTI_NPU/...; a CPU-only job is MULTI_CPU), so on CPU the FSDP plugin is dropped "
            "silently. The DP guarantee is unaffected (DDP is exact for every clipping mode); memory is not sharded."
        )
        logger.warning(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)

    def _validate_against_dataset(self) -> None:
        """Checks that need N: q <= 1 (raises) and δ < 1/N (warns)."""
        _ = self.sample_rate
        n = self.num_examples_private
        if self.args.target_delta is not None and self.args.target_delta >= 1.0 / n:
            warnings.warn(
                f"target_delta={self.args.target_delta} is not below 1/N = {1.0 / n:.3g}: a mechanism that publishes "
                "one random example in full satisfies (0, 1/N)-DP. Choose δ well below 1/N.",
                NotPrivateWarning,
                stacklevel=3,
            )

    def _setup_group_clipping(self) -> None:
        """Groups, thresholds and (for per-layer modes) clipping fused into the backward pass (He et al. 2023)."""
        args = self.args
        groups = build_groups(self.clipping_engine, args.clipping, args.clipping_groups)
        k = len(groups)
        if args.group_max_grad_norms is not None:
            if len(args.group_max_grad_norms) != k:
                raise ValueError(
                    f"group_max_grad_norms has {len(args.group_max_grad_norms)} values but there are {k} clipping "
                    f"groups: {[g.name for g in groups]}."
                )
            thresholds = list(args.group_max_grad_norms)
        else:
            thresholds = [args.per_sample_max_grad_norm / math.sqrt(k)] * k  # App. A.1: ‖C‖ = C
        adaptive = args.clipping == "adaptive_per_layer"
        self.group_clipper = GroupClipper(
            groups, thresholds, adaptive=adaptive, target_quantile=args.target_quantile, quantile_lr=args.quantile_lr,
            rescale_to=args.per_sample_max_grad_norm if args.adaptive_rescale_to_global else None,
        )
        self.clipping_engine.set_fused_groups([g.params for g in groups], self.group_clipper.factors)
        if adaptive and self.noise_multiplier is not None:
            self._quantile_noise()  # fail now if σ_new is not real

    def _quantile_noise(self) -> tuple[float, float]:
        """``(σ_new, σ_b)`` for adaptive clipping (Prop. 3.1); ``(σ, 0)`` otherwise."""
        if self.group_clipper is None or not self.group_clipper.adaptive:
            return float(self.noise_multiplier), 0.0
        fraction = None if self.args.quantile_noise_multiplier is not None else self.args.quantile_budget_fraction
        return split_noise_for_quantiles(self.noise_multiplier, self.group_clipper.num_groups, fraction,
                                         self.args.quantile_noise_multiplier)

    def _noise_stds(self) -> float | dict[str, float]:
        """Noise std on each parameter's summed clipped gradient: ``σ C`` (flat) or per group (noise.py)."""
        if self.group_clipper is None:
            return self.noise_std
        sigma_grad, _ = self._quantile_noise()
        groups = self.group_clipper.groups
        engine = self.clipping_engine
        dims = [sum(engine.params[n].numel() for n in g.params) for g in groups]
        stds, _ = group_noise_stds(self.group_clipper.thresholds.tolist(), dims, self.noise_allocation, sigma_grad)
        return {n: std for g, std in zip(groups, stds) for n in g.params}

    # ------------------------------------------------------------------ quantities of the mechanism
    @property
    def user_level(self) -> bool:
        return self.args.privacy_unit == "user"

    @property
    def num_examples_private(self) -> int:
        """N: the number of privacy units in the training set (examples, or users with ``privacy_unit='user'``)."""
        if self.train_dataset is None:
            raise ValueError("DPTrainer needs a train_dataset.")
        if self.user_level:
            return int(self._unit_ids().max()) + 1
        return len(self.train_dataset)

    def _unit_ids(self) -> np.ndarray:
        """User index (0..U-1) of every training example, from ``user_id_column``."""
        cached = getattr(self, "_unit_cache", None)
        if cached is not None and cached[0] is self.train_dataset:
            return cached[1]
        column = self.args.user_id_column
        try:
            values = self.train_dataset[column]
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise ValueError(f"privacy_unit='user': the training set has no column {column!r}.") from err
        ids = np.unique(np.asarray(list(values)), return_inverse=True)[1].reshape(-1)
        self._unit_cache = (self.train_dataset, ids)
        return ids

    @property
    def expected_batch_size(self) -> int:
        """Expected logical batch (users with ``privacy_unit="user"``): per-device batch × accumulation × processes."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size

    @property
    def sample_rate(self) -> float:
        """q = expected batch size / N (N counts privacy units)."""
        q = self.expected_batch_size / self.num_examples_private
        if q > 1:
            unit = "users" if self.user_level else "training set size"
            raise ValueError(
                f"The expected batch size {self.expected_batch_size} exceeds the {unit} "
                f"{self.num_examples_private} (q = {q:.3f} > 1). Lower per_device_train_batch_size or "
                "gradient_accumulation_steps."
            )
        return q

    @property
    def target_delta(self) -> float:
        """δ: the argument, or ``1 / N^1.1`` (below 1/N)."""
        if self.args.target_delta is not None:
            return self.args.target_delta
        return 1.0 / self.num_examples_private**1.1

    @property
    def steps_per_epoch(self) -> int:
        """Logical steps per epoch: ``ceil(N / expected batch size)`` (= ceil(1/q))."""
        return math.ceil(self.num_examples_private / self.expected_batch_size)

    @property
    def noise_std(self) -> float:
        """Std of the noise on the summed clipped gradient: σ · C (flat clipping's sensitivity is C)."""
        return float(self.noise_multiplier) * self.args.per_sample_max_grad_norm

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
        seed = self._shared_seed()
        self._noise = NoiseGenerator(seed)
        common = dict(num_chunks=self.args.gradient_accumulation_steps, seed=self._noise.seed,
                      rank=self.args.process_index, world_size=self.args.world_size)
        if self.user_level:
            units = self._unit_ids()
            sampler = PoissonUserSampler(units, self.sample_rate, self.steps_per_epoch,
                                         max_examples_per_user=self.args.max_examples_per_user, **common)
            dataset = _UnitTaggedDataset(dataset, units)
        elif self.args.poisson_sampling:
            sampler = PoissonBatchSampler(self.num_examples_private, self.sample_rate, self.steps_per_epoch, **common)
        else:
            sampler = ShuffledBatchSampler(self.num_examples_private, self.expected_batch_size, **common)
        self._dp_sampler = sampler
        # Deliberately not `accelerator.prepare`d: its even_batches/BatchSamplerShard would re-shard, pad or repeat
        # examples and break the sampling analysis (PITFALLS 2). Inputs are moved to the device in training_step.
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=_EmptySafeCollator(collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )
        if self._fsdp is not None:
            self._fsdp.dummy_source = loader  # FSDP: padding micro-batches (weight 0) are collated from it
        return loader

    def _shared_seed(self) -> int:
        """The run's DP seed (``dp_seed`` or a secret one), identical on every rank."""
        seed = self.args.dp_seed if self.args.dp_seed is not None else secrets.randbits(63)
        if _distributed():
            box = [seed]
            dist.broadcast_object_list(box, src=0)
            seed = box[0]
        return seed

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """Fetch a step's chunks. ``num_items_in_batch`` is not computed: DP losses are per example."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    def floating_point_ops(self, inputs: dict) -> int:
        return 0 if _is_empty(inputs) else super().floating_point_ops(inputs)

    # ------------------------------------------------------------------ the DP step
    @staticmethod
    def _slice_batch(inputs: dict, sl: slice, batch: int) -> dict:
        return {k: v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
                for k, v in inputs.items()}

    def _micro_batches(self, inputs: dict, labels: torch.Tensor,
                       units: torch.Tensor | None = None) -> list[tuple[dict, torch.Tensor, torch.Tensor | None]]:
        """Split a chunk into micro-batches of at most ``per_device_train_batch_size`` examples (memory only).

        With user-level units, a user's examples (contiguous in the chunk) are never split: a micro-batch holds whole
        users, and a user with more examples than the bound gets a micro-batch of their own.
        """
        batch = labels.shape[0]
        size = max(1, self._train_batch_size or self.args.per_device_train_batch_size)
        if units is None:
            bounds = list(range(0, batch, size)) + [batch]
        else:
            changes = (units[1:] != units[:-1]).nonzero().flatten() + 1
            edges = [0, *changes.tolist(), batch]
            bounds = [0]
            for block_start, block_end in zip(edges[:-1], edges[1:]):
                if block_end - bounds[-1] > size and block_start > bounds[-1]:
                    bounds.append(block_start)  # close the micro-batch before this user
            bounds.append(batch)
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sl = slice(a, b)
            out.append((self._slice_batch(inputs, sl, batch), labels[sl], None if units is None else units[sl]))
        return out

    def _unit_layout(self, units: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Local unit ids ``0..U-1`` of a micro-batch and the weights ``w_i`` of each user's contribution."""
        if units is None:
            return None, None
        local = torch.unique_consecutive(units, return_inverse=True)[1]
        if self.args.user_contribution == "sum":
            return local, None
        counts = torch.bincount(local)
        return local, 1.0 / counts[local].double()

    def _self_check(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """Once per run: the engine against autograd and single-example runs on real data (engine.self_check)."""
        b = labels.shape[0]

        def run_losses(sl: slice) -> torch.Tensor:
            part, part_labels = self._slice_batch(micro, sl, b), labels[sl]
            with self.compute_loss_context_manager():
                return self.per_example_loss(net(**self._model_inputs(net, part, part_labels)), part_labels)

        low_precision = self.args.bf16 or self.args.fp16
        was_training = net.training
        net.eval()  # dropout off: the batched and single-example runs must compute the same function
        try:
            self.clipping_engine.self_check(run_losses, b, rtol=5e-2 if low_precision else 1e-3)
        finally:
            net.train(was_training)
        self._self_checked = True

    def _segment_ids(self, inputs: dict) -> torch.Tensor | None:
        """``(rows, T)``: the example each token of a padding-free packed micro-batch belongs to (``DPSFTTrainer``);
        ``None`` when every row is one example."""
        return None

    def _model_inputs(self, model, inputs: dict, labels: torch.Tensor) -> dict:
        inputs = dict(inputs)
        if self.task == "seq2seq_lm" and "decoder_input_ids" not in inputs:
            base = getattr(model, "get_base_model", lambda: model)()
            inputs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=labels)
        return inputs

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """Clip each example's gradient and add it to the step's sum; at the step's last chunk, privatize."""
        if self._fsdp is not None:  # FSDP2: two-pass ghost clipping, noise on the local shards (clipping/fsdp.py)
            return self._fsdp.training_step(model, None if _is_empty(inputs) else inputs)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        loss_sum = torch.zeros((), device=self.args.device)
        if not _is_empty(inputs):
            inputs = self._prepare_inputs(inputs)
            if "labels" not in inputs:
                raise ValueError("DPTrainer needs `labels` in every batch to compute per-example losses.")
            labels = inputs.pop("labels")
            units_all = inputs.pop(_UNIT, None)
            net = self.accelerator.unwrap_model(model)
            engine = self.clipping_engine
            for micro, micro_labels, micro_units in self._micro_batches(inputs, labels, units_all):
                segments = self._segment_ids(micro)  # packed rows (DPSFTTrainer): each token's example; else None
                rows = micro_labels.shape[0]
                b = rows if segments is None else int(segments.max()) + 1
                if self.args.dp_self_check and not getattr(self, "_self_checked", False):
                    self._self_check(net, micro, micro_labels)
                units, weights = self._unit_layout(micro_units)
                if units is not None:
                    units, weights = units.to(labels.device), None if weights is None else weights.to(labels.device)
                with self.compute_loss_context_manager(), engine.record(rows, units=units, unit_weights=weights,
                                                                        segments=segments):
                    outputs = net(**self._model_inputs(net, micro, micro_labels))
                    losses = self.per_example_loss(outputs, micro_labels,
                                                   **({} if segments is None else {"segments": segments}))
                    del outputs  # the logits are freed during the backward pass, not kept to the end of the step
                    if losses.shape != (b,):
                        raise ValueError(f"per_example_loss must return shape ({b},), got {tuple(losses.shape)}.")
                    if losses.requires_grad:
                        losses.sum().backward()
                    losses = losses.detach()
                if self.group_clipper is None:
                    norms_sq = engine.per_example_norms_sq()  # per user with user-level units
                    n_units = b if units is None else int(units.max()) + 1
                    factors = flat_clip_factors(norms_sq, self.args.per_sample_max_grad_norm, n_units)
                    engine.accumulate_clipped(factors.to(losses.device))
                else:
                    engine.finish_fused()  # groups were clipped during the backward pass
                engine.clear()
                loss_sum = loss_sum + losses.detach().sum().to(loss_sum.device)
        if self.accelerator.gradient_state.sync_gradients:
            self._finish_dp_step()
        # Logged loss: Σ_i L_i / (expected local batch); summed over the step's chunks this is the mean loss.
        local_expected = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return loss_sum / local_expected

    def _finish_dp_step(self) -> None:
        """Noise once, divide by the expected batch size, write ``.grad``, record the step."""
        engine = self.clipping_engine
        summed = engine.pop_summed_grads()
        if not self._budget_allows(1):
            # Never release a step beyond the budget: no gradient, no update, nothing recorded.
            self.budget_exhausted = True
            self.control.should_training_stop = True
            for p in engine.params.values():
                p.grad = None
            return
        device = next(iter(summed.values())).device
        stds = self._noise_stds()
        adaptive = self.group_clipper is not None and self.group_clipper.adaptive
        if adaptive:
            # The clip counts are released with the gradient, in the same noised all-reduce (Alg. 1 lines 15-16).
            first = next(iter(summed.values()))
            summed[_COUNTS] = self.group_clipper.pop_counts().to(device=device, dtype=first.dtype)
            stds = {**stds, _COUNTS: self._quantile_noise()[1]}
        grads = privatize(summed, stds, self.expected_batch_size, self._noise.for_step(self.accountant.steps, device))
        if adaptive:
            self.group_clipper.update(grads.pop(_COUNTS) + 0.5)  # b̃_k = (Σ(b − ½) + z) / B + ½
        for name, p in engine.params.items():
            p.grad = grads[name].to(p.dtype)
        self.accountant.step(self.noise_multiplier, self.sample_rate)

    # ------------------------------------------------------------------ accounting
    def _dp_on_train_begin(self, state) -> None:
        if _distributed() and self._fsdp is None:  # under FSDP every coordinate lives on one rank only
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0)
        remaining = max(state.max_steps - state.global_step, 0)
        if self.accountant.steps != state.global_step:
            raise RuntimeError(
                f"The accountant has {self.accountant.steps} steps but the Trainer is at step {state.global_step}: "
                "resume from a checkpoint written by DPTrainer (it holds dp_state.json)."
            )
        if self.noise_multiplier is None:
            self.noise_multiplier = calibrate_noise_multiplier(
                self.args.target_epsilon, self.target_delta, self.sample_rate, max(remaining, 1),
                accountant=self.args.accountant, history=list(self.accountant.history),
            )
            logger.info("hf_dp: calibrated noise multiplier σ=%.4f for %d steps at q=%.5f to reach ε=%s, δ=%.3g",
                        self.noise_multiplier, remaining, self.sample_rate, self.args.target_epsilon,
                        self.target_delta)
        if self.group_clipper is not None:
            self._quantile_noise()  # adaptive clipping: fails loudly if σ_new = (σ⁻² − K/(2σ_b)²)^(-1/2) is not real
        self.accountant.planned_steps = state.max_steps
        self._allowed_steps = self._steps_within_budget(remaining)
        if not self.args.poisson_sampling:
            logger.warning("hf_dp: shuffled fixed-size batches: the reported ε assumes Poisson sampling and is "
                           "heuristic for this run.")

    def _steps_within_budget(self, planned: int) -> int | None:
        """How many more steps the budget allows (None: unlimited, when ε is reported rather than targeted)."""
        target = self.args.target_epsilon
        if target is None:
            return None

        def eps_after(n: int) -> float:
            acc = self.accountant.copy()
            acc.planned_steps = None  # the same computation as the calibration
            acc.step(self.noise_multiplier, self.sample_rate, n)
            return acc.get_epsilon(self.target_delta)

        if planned > 0 and eps_after(planned) <= target:
            return planned
        lo, hi = 0, max(planned, 1)  # eps_after(lo) <= target < eps_after(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if eps_after(mid) <= target else (lo, mid)
        return lo

    def _budget_allows(self, n: int) -> bool:
        if self._allowed_steps is None:
            return True
        return self.accountant.steps - self._steps_at_train_begin + n <= self._allowed_steps

    @property
    def _steps_at_train_begin(self) -> int:
        return getattr(self, "_dp_steps_at_begin", 0)

    def _group_logs(self) -> dict[str, float]:
        """Thresholds and privatized unclipped fractions per group (only released quantities are logged)."""
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

    def dp_guarantee_notes(self) -> list[str]:
        """Why the run's guarantee is not the strict (ε, δ)-DP that the accountant reports, if it is not.

        Collects the trainer's own reasons and those of every callback that has a ``dp_guarantee_notes()`` method
        (flatness regularisers, audits, ...). An empty list means the guarantee is strict.
        """
        notes = []
        if self.noise_multiplier == 0:
            notes.append("no noise (noise_multiplier=0): not differentially private")
        if not self.args.poisson_sampling:
            notes.append("shuffled fixed-size batches: the reported ε assumes Poisson sampling")
        if self.args.dp_seed is not None:
            notes.append("fixed dp_seed: the sampling and the noise are predictable to anyone who knows it")
        if self.args.load_best_model_at_end:
            notes.append("checkpoint selected on evaluation metrics (not covered if the evaluation data is private)")
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

    def privacy_spent(self, delta: float | None = None) -> dict[str, Any]:
        """The guarantee so far: ε at δ (configured accountant; PRV upper bound by default) and the mechanism."""
        delta = self.target_delta if delta is None else delta
        exact = self.accountant.copy()
        exact.planned_steps = None  # a discretisation sized for exactly the steps taken, as in the calibration
        return {
            "epsilon": exact.get_epsilon(delta),
            "delta": delta,
            "accountant": self.args.accountant,
            "steps": self.accountant.steps,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "per_sample_max_grad_norm": self.args.per_sample_max_grad_norm,
            "poisson_sampling": self.args.poisson_sampling,
            "dp_guarantee": self.dp_guarantee,
        }

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds ``epsilon`` (spent so far) to every log, next to the loss."""
        if self.accountant.steps > 0 and self.train_dataset is not None:
            logs = {**logs, "epsilon": round(self.accountant.get_epsilon(self.target_delta), 4)}
            if self.group_clipper is not None:
                logs.update(self._group_logs())
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; on resume, also restores the accountant so that ε continues exactly."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            self._load_dp_state(resume_from_checkpoint)
        else:
            self.accountant = PrivacyAccountant(accountant=self.args.accountant)
            self.noise_multiplier = self.args.noise_multiplier
        self._dp_steps_at_begin = self.accountant.steps
        self.budget_exhausted = False
        self._self_checked = False
        if self._fsdp is not None:
            self._fsdp.reset()
        if self.train_dataset is not None:
            self._validate_against_dataset()
        if resume_from_checkpoint and self.args.target_epsilon is not None and self.noise_multiplier is not None:
            acc = self.accountant.copy()
            acc.step(self.noise_multiplier, self.sample_rate)
            if acc.get_epsilon(self.target_delta) > self.args.target_epsilon:
                logger.warning(
                    "hf_dp: not resuming training: the privacy budget ε=%s (δ=%.3g) is spent (ε=%.4f after %d steps) "
                    "and one more step would exceed it.",
                    self.args.target_epsilon, self.target_delta, self.accountant.get_epsilon(self.target_delta),
                    self.accountant.steps,
                )
                self.budget_exhausted = True
                return TrainOutput(self.accountant.steps, float("nan"), {"epsilon": self.accountant.get_epsilon(
                    self.target_delta)})
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def _dp_state(self) -> dict[str, Any]:
        return {
            "accountant": self.accountant.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "per_sample_max_grad_norm": self.args.per_sample_max_grad_norm,
            "num_examples": self.num_examples_private,
            "target_epsilon": self.args.target_epsilon,
            "target_delta": self.target_delta,
            "poisson_sampling": self.args.poisson_sampling,
            "clipping": self.args.clipping,
            "accountant_name": self.args.accountant,
            "epsilon": self.accountant.get_epsilon(self.target_delta) if self.accountant.steps else 0.0,
            "expected_batch_size": self.expected_batch_size,
            "dp_guarantee": self.dp_guarantee,
            "noise_allocation": self.noise_allocation if self.group_clipper is not None else None,
            "group_clipping": self.group_clipper.state_dict() if self.group_clipper is not None else None,
        }

    def save_model(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> None:
        """``Trainer.save_model``, plus the privacy state (``dp_state.json``) next to the weights.

        ``Trainer._save_checkpoint`` saves through this method, so every checkpoint holds the accountant's state.
        """
        super().save_model(output_dir, *args, **kwargs)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self.accountant.steps > 0 and os.path.isdir(output_dir):
            with open(os.path.join(output_dir, DP_STATE_NAME), "w") as f:
                json.dump(self._dp_state(), f, indent=2)
            # Every checkpoint and the final output carry a card with the privacy metadata (cards.py).
            create_model_card(self, output_dir=output_dir, model_name=os.path.basename(os.path.normpath(
                self.args.output_dir)))

    def create_model_card(self, language: str | None = None, license: str | None = None, tags: Any = None,
                          model_name: str | None = None, finetuned_from: str | None = None, tasks: Any = None,
                          dataset_tags: Any = None, dataset: Any = None, dataset_args: Any = None,
                          **kwargs: Any) -> None:
        """The model card with a ``differential_privacy`` record (``hf_dp/cards.py``), also what ``push_to_hub``
        uploads. Same signature as ``Trainer.create_model_card``."""
        if self.accountant.steps == 0:
            return None
        create_model_card(self, output_dir=self.args.output_dir, model_name=model_name, tags=tags, language=language,
                          license=license, finetuned_from=finetuned_from, tasks=tasks, dataset=dataset, **kwargs)

    def _push_from_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """``Trainer._push_from_checkpoint``, with the checkpoint's privacy card and ``dp_state.json`` in the upload.

        With ``push_to_hub`` and ``hub_strategy`` ``"every_save"``/``"checkpoint"``/``"all_checkpoints"``, the
        Trainer copies only a fixed list of files (weights, config, adapter files) from the new checkpoint into
        ``output_dir``, re-saves the tokenizer and training arguments there, and uploads ``output_dir``. The card
        (``README.md``) and ``dp_state.json`` would stay behind, so the Hub would show weights without (or with a
        stale) privacy guarantee. Before that upload, this copies the checkpoint's ``dp_state.json`` and writes the
        card of the checkpoint's ε into ``output_dir``: re-rendered there (keeping metadata set on an existing
        README, merging into one hf_dp did not write) when the accountant is at the checkpoint's step, as it is
        when ``_save_checkpoint`` calls this; otherwise the checkpoint's own card is copied. The conditions under
        which the Trainer skips the push are mirrored, so ``output_dir`` never gets a card newer than its weights.
        """
        import shutil

        from transformers.trainer_utils import HubStrategy

        checkpoint_folder = str(args[0] if args else kwargs["checkpoint_folder"])
        will_push = (
            self.is_world_process_zero()
            and self.args.hub_strategy != HubStrategy.END
            and (self.args.hub_always_push or self.push_in_progress is None or self.push_in_progress.is_done())
        )
        state_path = os.path.join(checkpoint_folder, DP_STATE_NAME)
        if will_push and os.path.isfile(state_path):
            output_dir = self.args.output_dir
            os.makedirs(output_dir, exist_ok=True)
            with open(state_path) as f:
                checkpoint_steps = sum(int(r["steps"]) for r in json.load(f)["accountant"]["history"])
            card_path = os.path.join(checkpoint_folder, "README.md")
            target = os.path.join(output_dir, "README.md")
            if checkpoint_steps == self.accountant.steps and os.path.isfile(target):
                create_model_card(self, output_dir=output_dir, model_name=os.path.basename(os.path.normpath(
                    output_dir)))
            elif os.path.isfile(card_path):
                shutil.copy(card_path, target)
            else:
                raise FileNotFoundError(
                    f"{checkpoint_folder} holds {DP_STATE_NAME} but no README.md: refusing to push weights to the "
                    "Hub without their privacy card."
                )
            shutil.copy(state_path, os.path.join(output_dir, DP_STATE_NAME))
        return super()._push_from_checkpoint(*args, **kwargs)

    def _load_dp_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, DP_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {DP_STATE_NAME}: the privacy spent before it is unknown, so resuming would "
                "under-count ε. Resume only from checkpoints written by DPTrainer."
            )
        with open(path) as f:
            state = json.load(f)
        self.accountant = PrivacyAccountant(accountant=self.args.accountant)
        self.accountant.load_state_dict(state["accountant"])
        if self.group_clipper is not None and state.get("group_clipping"):
            self.group_clipper.load_state_dict(state["group_clipping"])  # thresholds continue where they were
        if self.args.noise_multiplier is None:
            self.noise_multiplier = state["noise_multiplier"]
        else:
            self.noise_multiplier = self.args.noise_multiplier
        if abs(state["sample_rate"] - self.sample_rate) > 1e-12 or \
                state["per_sample_max_grad_norm"] != self.args.per_sample_max_grad_norm:
            warnings.warn(
                "Resuming with a different sampling rate or clipping norm than the checkpoint; the accountant "
                "composes both mechanisms.",
                UserWarning,
                stacklevel=3,
            )
