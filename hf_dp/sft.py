"""DP supervised fine-tuning with trl: :class:`DPSFTTrainer` and :class:`DPSFTConfig`.

``DPSFTTrainer`` is trl's ``SFTTrainer`` — its data formats (``text``, ``messages`` with the chat template,
``prompt``/``completion`` standard and conversational), its labels (completion-only and assistant-only loss: trl sets
the other tokens' labels to −100), PEFT through ``peft_config=``, tags and model card — whose optimizer steps are
:class:`~hf_dp.DPTrainer`'s DP steps: the same sampler, clipping engine, noise and accountant (Abadi et al. 2016;
Li et al. 2022 §2). The privacy unit is one row of ``train_dataset`` (one user with ``privacy_unit="user"``) and each
example's loss is the mean over its own trained tokens.

**Packing keeps the example the unit.** trl's ``packing=True`` packs the *dataset* into blocks of ``max_length``
tokens before training, so a block of several people's texts would become the unit and N would count blocks. Here
the training set is never packed: rows are Poisson-sampled (q = expected batch / number of rows) and the *sampled*
rows are flattened padding-free at collation (trl's ``DataCollatorForLanguageModeling(padding_free=True)``:
``position_ids`` restart at 0 for each example, and each example's first label is −100). The clipping engine splits
every layer's captured activations and output gradients back into per-example blocks (``ClippingEngine.record(...,
segments=)``), so norms (ghost or instantiated) and clipped sums are per example, and the loss is the mean over each
example's own tokens (:func:`causal_lm_segment_loss`). This is exact only if the model keeps packed examples apart
(block-diagonal attention): transformers 5 does so for sdpa/eager attention from ``position_ids`` when there is no
attention mask and no cache (``use_cache=False`` is passed), and flash-attention does so from ``cu_seq_lens``.
:meth:`DPSFTTrainer.check_packed_isolation` verifies it on the model at construction and at every train start, and
packing is refused where it does not hold (e.g. OPT's learned positions from the attention mask, Bloom's ALiBi).

Activation (gradient) checkpointing, which trl turns on by default, stays on: the per-example hooks record each
layer's input from the recomputed segment (``clipping/checkpointing.py``), so DP keeps its memory saving.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from trl import SFTConfig, SFTTrainer

from .arguments import DPTrainingArguments, TrlOverridesUnderDP
from .chunked_loss import register_token_loss
from .clipping.checks import check_rtol
from .clipping.engine import train_without_dropout
from .clipping.rules import UnsupportedLayerError
from .losses import (
    IGNORE_INDEX,
    causal_lm_loss,
    causal_lm_targets,
    default_per_example_loss,
    label_smoothed_default,
    mean_over_targets,
    token_cross_entropy,
)
from .peft_support import is_peft_model
from .trainer import DPTrainer

__all__ = ["DPSFTConfig", "DPSFTTrainer", "causal_lm_segment_loss", "segment_ids"]

logger = logging.getLogger(__name__)


@dataclass
class DPSFTConfig(TrlOverridesUnderDP, SFTConfig, DPTrainingArguments):
    r"""Configuration of [`DPSFTTrainer`]: trl's `SFTConfig` plus every field of [`DPTrainingArguments`].

    Both sets of fields come from their own classes (nothing is copied); both `__post_init__` validations run
    (trl's, then hf_dp's, then trl's remaining ones). trl's defaults are kept (`logging_steps=10`,
    `learning_rate=2e-5`, ...), except:

    - (`gradient_checkpointing` keeps trl's `True`: exact under DP, with its memory saving;
      `clipping/checkpointing.py`.)
    - `bf16`: when not set, `True` only if `fp16` is not set **and** an accelerator is present (trl: whenever `fp16`
      is not set, also on CPU, where bf16 autocast is slow and inexact).
    - `max_grad_norm`: `0.0` (DP clips per example with `per_sample_max_grad_norm`; see `DPTrainingArguments`).

    With `packing=True`, the *sampled* rows of each step are packed padding-free at collation; the dataset itself is
    never packed (see `hf_dp/sft.py`), so `packing_strategy` must be `"bfd"` (the default; `max_length` truncates
    each row) and `sample_rate` counts rows.
    """

    def __post_init__(self):
        super().__post_init__()
        if (self.packing or self.padding_free) and self.packing_strategy != "bfd":
            raise ValueError(
                f"packing_strategy={self.packing_strategy!r}: under DP the dataset is never packed (a packed block of "
                "several examples would become the privacy unit); the sampled rows of each step are packed whole at "
                "collation, each truncated to max_length. Use packing_strategy='bfd' (the default)."
            )
        if self.loss_type != "nll":
            raise ValueError(f"loss_type={self.loss_type!r}: DP-SFT trains the per-example NLL; use loss_type='nll'.")
        if self.activation_offloading:
            raise ValueError("activation_offloading is not supported under DP (untested with the per-example hooks).")


def _dp_sft_config(args: Any) -> DPSFTConfig:
    """``args`` as a :class:`DPSFTConfig`: upgrades ``DPTrainingArguments`` (as ``SFTTrainer`` upgrades
    ``TrainingArguments`` to ``SFTConfig``)."""
    if isinstance(args, DPSFTConfig):
        return args
    if isinstance(args, DPTrainingArguments):
        names = {f.name for f in dataclasses.fields(DPSFTConfig) if f.init}
        values = {k: v for k, v in args.to_dict().items() if k in names}
        values["hub_token"] = args.hub_token  # to_dict hides it
        return DPSFTConfig(**values)
    raise TypeError(
        "DPSFTTrainer needs DPSFTConfig(target_epsilon=... or noise_multiplier=..., ...) (or DPTrainingArguments), "
        f"got {type(args).__name__}."
    )


# ---------------------------------------------------------------------- packed rows
def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``(1, T)`` padding-free ``position_ids`` (restarting at 0 per example) → the example ``0..S-1`` of each token.

    Raises if the positions are not ``0, 1, 2, ...`` within every example (then the row is not a packing of whole
    examples that hf_dp could split).
    """
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"Packed batches must be one padding-free row; got position_ids {tuple(position_ids.shape)}.")
    pos = position_ids[0]
    starts = pos == 0
    if pos.numel() == 0 or not bool(starts[0]) or not bool((pos[1:] == pos[:-1] + 1)[~starts[1:]].all()):
        raise ValueError("Packed position_ids must restart at 0 for every example and count up by 1 within it.")
    return (torch.cumsum(starts.long(), 0) - 1).unsqueeze(0)


def _packed_fields(position_ids: torch.Tensor) -> dict[str, Any]:
    """The varlen fields trl's padding-free collator derives from ``position_ids`` (cu_seq_lens, max lengths,
    seq_idx), for a slice of a packed row."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    lengths = cu.diff()
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
            "max_length_k": int(lengths.max()),
            "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32, device=cu.device),
                                               lengths.to(torch.long))[None]}


def causal_lm_segment_loss(outputs: Any, labels: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example next-token loss; for a padding-free packed row, per packed example.

    Without ``segments`` this is :func:`hf_dp.causal_lm_loss`. With ``segments`` (``(1, T)``, the example of each
    token), example ``i``'s loss is the mean over its own trained tokens of the cross-entropy of ``logits[t]`` against
    ``labels[t + 1]``, counting only predictions whose target is in the same example (a prediction across the
    boundary of two packed examples is never trained, whatever the collator put there). Returns ``(S,)``.
    """
    if segments is None:
        return causal_lm_loss(outputs, labels)
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    targets = segment_targets(labels, segments)
    return segment_means(token_cross_entropy(logits, targets), targets, segments)


def segment_targets(labels: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The target of each position of a (packed) causal LM row: ``labels[t + 1]``, ignored where it lies in
    another packed example or in padding (``segments < 0``). ``segments=None``: :func:`hf_dp.losses.causal_lm_targets`.
    """
    if segments is None:
        return causal_lm_targets(labels)
    seg = segments.reshape(-1)
    target = F.pad(labels.reshape(-1)[1:], (0, 1), value=IGNORE_INDEX)
    same = F.pad(seg[1:] == seg[:-1], (0, 1), value=False)
    return target.masked_fill(~same | (seg < 0), IGNORE_INDEX).view(labels.shape)


def segment_means(per_token: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Each packed example's per-token losses averaged over its own trained targets, ``(S,)``; ``segments=None``:
    per row (:func:`hf_dp.losses.mean_over_targets`)."""
    if segments is None:
        return mean_over_targets(per_token, targets)
    per_token, target, seg = per_token.reshape(-1), targets.reshape(-1), segments.reshape(-1)
    num = int(seg.max()) + 1
    index = seg.clamp(min=0)
    trained = (target != IGNORE_INDEX).to(per_token.dtype)
    sums = per_token.new_zeros(num).index_add(0, index, per_token * trained)
    counts = per_token.new_zeros(num).index_add(0, index, trained)
    return sums / counts.clamp(min=1)



register_token_loss(causal_lm_segment_loss, segment_targets, segment_means)


def check_rows_have_tokens(dataset: Any) -> None:
    """Refuse, before training, a training set with a row of no tokens (e.g. user-tokenised with
    ``dataset_kwargs={"skip_prepare_dataset": True}``; trl's own preparation always adds an EOS).

    Such a row is no example: trl's collators cannot collate it (padded, its empty tensor takes a float dtype; packed,
    it adds no segment, so the rows of a packed batch no longer match its segments). It would stop the run whenever
    Poisson sampling first draws it, after steps were released, for a reason that lies in the data.
    """
    columns = getattr(dataset, "column_names", None) or []
    if "input_ids" not in columns or not hasattr(dataset, "with_format"):
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = dataset.with_format("arrow")["input_ids"]
    if not (pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)):
        return  # fixed-size rows (e.g. an Array2D column) cannot be empty
    lengths = pc.list_value_length(ids)
    empty = pc.index(lengths, 0).as_py()
    if empty >= 0:
        raise ValueError(
            f"Row {empty} of the training set has no tokens (empty input_ids): it is not an example that can be "
            "collated or trained, and would stop training mid-run whenever it is sampled. Remove such rows, e.g. "
            "train_dataset.filter(lambda row: len(row['input_ids']) > 0)."
        )


class _OneExamplePerSegment:
    """The training collator, checked: a padding-free batch must hold exactly one segment per sampled row (a row
    split in two, merged with another, or dropped would no longer be clipped as one example)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features: list) -> dict:
        batch = self.collator(features)
        num = int(segment_ids(batch["position_ids"]).max()) + 1
        if num != len(features):
            raise RuntimeError(
                f"The padding-free collator packed {len(features)} sampled rows into {num} segments: each row must "
                "become exactly one segment (an empty row, pad_to_multiple_of, or a collator that splits or merges "
                "rows breaks per-example clipping)."
            )
        return batch


def _example_bounds(starts: list[int], size: int, max_tokens: int | None, units: torch.Tensor | None) -> list[int]:
    """Micro-batch boundaries over the examples of a packed row (token offsets ``starts``, one more than examples):
    at most ``size`` examples and ``max_tokens`` tokens each (a longer single example or user stands alone); a
    user's examples are never split."""
    num = len(starts) - 1
    if units is None:
        edges = list(range(num + 1))
    else:
        edges = [0, *((units[1:] != units[:-1]).nonzero().flatten() + 1).tolist(), num]
    bounds = [0]
    for a, b in zip(edges[:-1], edges[1:]):
        too_many = b - bounds[-1] > size or (max_tokens is not None and starts[b] - starts[bounds[-1]] > max_tokens)
        if a > bounds[-1] and too_many:
            bounds.append(a)
    return bounds + [num]


class _SFTTrainer(SFTTrainer):
    """``SFTTrainer`` taking its ``peft_config`` as ``trl_peft_config``: ``DPTrainer.__init__`` consumes a
    ``peft_config`` keyword itself, and here trl applies the adapter (model given by name, added chat tokens, ...)."""

    def __init__(self, *args: Any, trl_peft_config: Any = None, **kwargs: Any):
        super().__init__(*args, peft_config=trl_peft_config, **kwargs)


class DPSFTTrainer(DPTrainer, _SFTTrainer):
    """trl's ``SFTTrainer`` whose optimizer steps are DP-SGD / DP-Adam steps (``DPTrainer``'s machinery).

    Use it as ``SFTTrainer``, with :class:`DPSFTConfig`::

        args = DPSFTConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=0.1, packing=True,
                           per_device_train_batch_size=16, gradient_accumulation_steps=8, learning_rate=2e-4)
        trainer = DPSFTTrainer(model=model, args=args, train_dataset=chats, peft_config=LoraConfig(...))
        trainer.train()

    Args:
        model, args, *args, **kwargs: as for ``SFTTrainer`` (``args`` may also be ``DPTrainingArguments``).
        peft_config: a ``peft.PeftConfig``, applied by trl; only the adapter is trained, exactly.
        per_example_loss: ``fn(outputs, labels[, segments=]) -> Tensor[num_examples]``; defaults to
            :func:`causal_lm_segment_loss`. With packing it must accept ``segments=``.

    With packing (``packing=True`` or ``padding_free=True``), a model that does not keep packed examples apart is
    refused (:meth:`check_packed_isolation`), as are prompt-learning adapters (their virtual tokens are shared by the
    whole packed row), ``pad_to_multiple_of``, and a training set that is already packed (a ``seq_lengths`` column).
    """

    _name = "DP-SFT"
    # trl's compute_loss (batch NLL through its fused LM head) serves evaluation only: training never calls it.
    _dp_compute_loss_is_not_trained = True

    def compute_loss(self, *args: Any, **kwargs: Any):
        """trl's ``compute_loss``, used by evaluation only (a DP step uses each example's own loss, per packed
        example with packing)."""
        return super().compute_loss(*args, **kwargs)

    def __init__(self, model: Any, args: Any = None, *pargs: Any, peft_config: Any = None,
                 per_example_loss: Any = None, **kwargs: Any):
        args = _dp_sft_config(args)
        super().__init__(model, args, *pargs, per_example_loss=per_example_loss, trl_peft_config=peft_config,
                         **kwargs)
        self._packing_collator = self.data_collator  # trl's padding-free collator (the isolation check's)
        check_rows_have_tokens(self.train_dataset)
        if self.padding_free:
            self._check_packing_supported()
            self.check_packed_isolation()

    # ------------------------------------------------------------------ data
    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """trl's preparation, except that the training set is never packed (packing happens at collation)."""
        if dataset_name == "train":
            packing = False
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _check_packing_supported(self) -> None:
        if self._fsdp is not None:
            raise ValueError(
                "Packing is not supported under FSDP (its two-pass ghost clipping has no per-segment split); use "
                "packing=False and padding_free=False, or DDP."
            )
        columns = getattr(self.train_dataset, "column_names", None) or []
        if "seq_lengths" in columns:
            raise ValueError(
                "The training set is already packed (it has a 'seq_lengths' column): each of its rows holds several "
                "examples, which would be clipped together as one unit. Pass the unpacked rows; with packing=True "
                "DPSFTTrainer packs each step's sampled rows at collation."
            )
        if self.data_collator is not None and getattr(self.data_collator, "pad_to_multiple_of", None):
            raise ValueError(
                "pad_to_multiple_of with padding-free packing adds padding tokens that look like extra examples; "
                "set pad_to_multiple_of=None."
            )
        if self.task == "custom" and "segments" not in inspect.signature(self.per_example_loss).parameters:
            raise ValueError(
                "With packing, per_example_loss must accept `segments=` (the example of each token of a packed row) "
                "and return one loss per packed example; or train with packing=False."
            )
        if is_peft_model(self.model):
            config = self.model.peft_config[self.model.active_adapter]
            if getattr(config, "is_prompt_learning", False):
                raise ValueError(
                    f"{config.peft_type.value} adds virtual tokens that every example of a packed row shares, so "
                    "their gradient cannot be split per example. Use packing=False with prompt-learning adapters."
                )

    def get_train_dataloader(self):
        """``DPTrainer``'s Poisson loader over rows; with packing, its collator is checked to give one segment per
        sampled row (:class:`_OneExamplePerSegment`)."""
        if not self.padding_free:
            return super().get_train_dataloader()
        collator = self.data_collator
        self.data_collator = _OneExamplePerSegment(collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def _check_batch_rows(self, num_examples: int, batch: dict) -> None:
        """A padding-free batch holds its examples as segments of one row: accept it iff there is one per example."""
        if self.padding_free and "position_ids" in batch:
            num = int(segment_ids(batch["position_ids"]).max()) + 1
            if num != num_examples:
                raise RuntimeError(f"A packed batch of {num_examples} sampled rows holds {num} segments.")
            return
        parent = getattr(super(), "_check_batch_rows", None)
        if parent is not None:
            parent(num_examples, batch)

    # ------------------------------------------------------------------ the DP step on packed rows
    def _default_loss(self, model: torch.nn.Module) -> tuple[Any, str]:
        """A causal LM's next-token loss per example, per packed example with padding-free packing
        (:func:`causal_lm_segment_loss`); other heads are refused, as is trl's mixture-of-experts load-balancing loss
        (trl turns the model's router logits on whenever ``router_aux_loss_coef`` is not 0, the architecture's own
        coefficient by default)."""
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef}: trl adds this Mixture-of-Experts model's "
                "load-balancing loss (it turns config.output_router_logits on; with router_aux_loss_coef=None, at the "
                "architecture's own coefficient), a statistic of the whole batch's routing, so one example's loss "
                "would depend on the other examples and could not be clipped per example. Set "
                "router_aux_loss_coef=0.0 in DPSFTConfig (each example's own token loss is trained)."
            )
        _, task = default_per_example_loss(model)
        if task != "causal_lm":
            raise ValueError(f"DPSFTTrainer trains causal language models; this model's head is {task}.")
        # trl smooths with LabelSmoother(shift_labels=True) (loss_type "nll"); here per packed example
        return label_smoothed_default(model, causal_lm_segment_loss, task, getattr(self.label_smoother, "epsilon", 0.0),
                                      targets=segment_targets, reduce=segment_means, shift=True), task

    def _segment_ids(self, inputs: dict) -> torch.Tensor | None:
        if not self.padding_free or "position_ids" not in inputs:
            return None
        return segment_ids(inputs["position_ids"])

    def _model_inputs(self, model, inputs: dict, labels: torch.Tensor) -> dict:
        # No cache: with one, transformers lets packed examples attend to each other (and trl passes it too).
        return {**super()._model_inputs(model, inputs, labels), "use_cache": False}

    def _micro_batches(self, inputs: dict, labels: torch.Tensor, units: torch.Tensor | None = None):
        """A packed chunk split into packed micro-batches of at most ``per_device_train_batch_size`` examples and
        ``max_length`` tokens (memory and attention cost only: the DP step is the same)."""
        segments = self._segment_ids(inputs)
        if segments is None:
            return super()._micro_batches(inputs, labels, units)
        length = segments.shape[1]
        starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [length]
        size = max(1, self._train_batch_size or self.args.per_device_train_batch_size)
        # At most max_length tokens per packed micro-batch as well: attention over a packed row costs O(T²) with
        # sdpa's block-diagonal mask, so rows of about max_length tokens (as trl's packed blocks) keep it linear.
        bounds = _example_bounds(starts, size, self.args.max_length, units)
        if len(bounds) == 2:
            return [(inputs, labels, units)]
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            t0, t1 = starts[a], starts[b]
            micro = {k: v[:, t0:t1] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == length else v
                     for k, v in inputs.items()}
            micro.update({k: v for k, v in _packed_fields(micro["position_ids"]).items() if k in inputs})
            out.append((micro, labels[:, t0:t1], None if units is None else units[a:b]))
        return out

    def _unpack(self, inputs: dict, labels: torch.Tensor, segments: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """A packed row as an ordinary right-padded batch ``(S, T_max)`` with an attention mask."""
        seg = segments[0]
        num = int(seg.max()) + 1
        pos = inputs["position_ids"][0]
        longest = int(pos.max()) + 1
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        ids = inputs["input_ids"].new_full((num, longest), pad_id)
        lab = labels.new_full((num, longest), IGNORE_INDEX)
        mask = inputs["input_ids"].new_zeros((num, longest))
        ids[seg, pos] = inputs["input_ids"][0]
        lab[seg, pos] = labels[0]
        mask[seg, pos] = 1
        position_ids = torch.arange(longest, device=ids.device).expand(num, longest)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, lab

    def _self_check(self, net: torch.nn.Module, micro: dict, labels: torch.Tensor) -> None:
        """``DPTrainer``'s check (hooks vs autograd, per-example vs alone) on the micro-batch unpacked; for a packed
        micro-batch also: each example's gradient norm from the packed row equals its norm from the unpacked batch
        (the per-segment split of every layer, on the real model and data), and the counterfactual check
        (``DPTrainer._check_examples_alone``, ``hf_dp/counterfactual.py``): each packed segment, as the DP step
        computes it at the lengths actually used, against that example collated alone by trl's unpacked collator —
        on this micro-batch and on a packed batch of the training set's shortest and longest rows."""
        segments = self._segment_ids(micro)
        if segments is None:
            return super()._self_check(net, micro, labels)
        self._check_loss_is_the_models_own(net, micro, labels)
        padded, padded_labels = self._unpack(micro, labels, segments)
        self._first_step_checks(net, padded, padded_labels)
        engine = self.clipping_engine
        saved = engine.fused_groups
        engine.set_fused_groups(None, None)
        try:
            with train_without_dropout(net):  # as training runs the model (eval mode may change it: bitsandbytes)
                packed = self._norms(net, micro, labels, segments)
                unpacked = self._norms(net, padded, padded_labels, None)
        finally:
            engine.set_fused_groups(*saved)
        rtol = check_rtol(self.args, net)
        if not torch.allclose(packed, unpacked, rtol=rtol, atol=1e-12):
            raise UnsupportedLayerError(
                f"Per-example gradient norms of a packed row ({packed.tolist()}) differ from those of the same "
                f"examples unpacked ({unpacked.tolist()}): some layer mixes the examples of a packed row or does not "
                "see one position per token. Train with packing=False."
            )
        self._check_examples_alone(net, micro, labels)  # each packed segment vs the example collated alone

    def _alone_collator(self, loader: Any = None) -> Any:
        """With packing, an example sampled alone is collated by trl's unpacked path (the same collator with
        ``padding_free=False``): the counterfactual each packed segment is compared with."""
        collator = self._packing_collator
        if self.padding_free and dataclasses.is_dataclass(collator) and any(
                f.name == "padding_free" for f in dataclasses.fields(collator)):
            return dataclasses.replace(collator, padding_free=False)
        return super()._alone_collator(loader)

    def _norms(self, net, inputs: dict, labels: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        extra = {} if segments is None else {"segments": segments}
        return self.clipping_engine.recorded_norms(
            lambda: self._example_losses(net, inputs, labels, **extra),
            labels.shape[0], segments, context=self.compute_loss_context_manager)

    # ------------------------------------------------------------------ isolation of packed examples
    def _dp_on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        check_rows_have_tokens(self.train_dataset)  # the training set may have been replaced since construction
        if self.padding_free:
            self.check_packed_isolation()  # the model may have changed since construction
        super()._dp_on_train_begin(*args, **kwargs)

    @torch.no_grad()
    def check_packed_isolation(self) -> None:
        """Refuse packing unless the model keeps the examples of a packed row apart.

        Runs the model (train mode with dropout off, no autocast, exactly the inputs training passes) on synthetic
        token ids: the middle example B of a packed row ``[A, B, C]`` must get the same logits when A and C are
        replaced by other tokens (no attention across examples: with it, B's clipped gradient would carry A's data),
        and the same logits as B alone (positions restart per example, so the packed run trains what the unpacked run
        trains).
        """
        net = self.accelerator.unwrap_model(self.model)
        collator = self._packing_collator
        vocab = net.get_input_embeddings().num_embeddings
        device = next(net.parameters()).device
        gen = torch.Generator().manual_seed(0)

        def tokens(n: int) -> list[int]:
            return torch.randint(1, vocab, (n,), generator=gen).tolist()

        a, b, c, a2, c2 = tokens(5), tokens(4), tokens(3), tokens(5), tokens(3)

        def logits(rows: list[list[int]]) -> torch.Tensor:
            batch = collator([{"input_ids": r} for r in rows])
            labels = batch.pop("labels")
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            return net(**self._model_inputs(net, batch, labels)).logits[0].double()

        # Train mode with dropout off, as training runs the model: an eval-mode forward is not what is trained, and
        # it may change the model (bitsandbytes on CPU repacks 4-bit weights for inference, after which a layer with
        # a bias cannot be trained).
        with train_without_dropout(net):
            first, second, alone = logits([a, b, c]), logits([a2, b, c2]), logits([b])
        mid = slice(len(a), len(a) + len(b))
        scale = 1.0 + float(first.abs().max())
        leak = float((first[mid] - second[mid]).abs().max())
        drift = float((first[mid] - alone).abs().max())
        low = next(net.parameters()).dtype in (torch.float16, torch.bfloat16)
        if leak > 1e-5 * scale or drift > (5e-2 if low else 1e-4) * scale:
            attn = getattr(getattr(net, "config", None), "_attn_implementation", None)
            raise ValueError(
                f"Packing refused: {type(self.accelerator.unwrap_model(self.model)).__name__} (attention "
                f"implementation {attn!r}) does not keep the examples of a padding-free packed row apart (the logits "
                f"of a packed example change by {leak:.3g} when its neighbours change, and differ by {drift:.3g} from "
                "the example alone), so one example's clipped gradient would carry the data of the others. Train "
                "with packing=False and padding_free=False, or use a model and attention implementation that derive "
                "a block-diagonal mask from position_ids / cu_seq_lens (e.g. Llama or GPT-2 with sdpa, eager or "
                "flash attention)."
            )
