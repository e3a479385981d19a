"""DP preference optimisation with trl: :class:`DPDPOTrainer` and :class:`DPDPOConfig`.

``DPDPOTrainer`` is trl's ``DPOTrainer`` (Rafailov et al. 2023) — its data formats (standard and conversational,
explicit or implicit prompt), tokenization, truncation, reference model, PEFT through ``peft_config=``, evaluation,
tags and model card — whose optimizer steps are :class:`~hf_dp.DPTrainer`'s DP-SGD / DP-Adam steps (Abadi et al.
2016): the same sampler, clipping engine, noise and accountant.

**The privacy unit is one preference row** (prompt, chosen, rejected), never one of its two sequences
(``hf_dp/preference.py``): rows are Poisson-sampled, and the gradient of the row's loss through both completions is
clipped as one unit. The loss of a row is trl's loss for that row alone — for every ``loss_type`` whose value on a
row depends on that row only: ``sigmoid`` (default, with ``beta``), ``hinge``, ``ipo``, ``exo_pair``, ``nca_pair``,
``robust``, ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm`` and ``sft`` (the
mean over the row's own chosen tokens), combined with ``loss_weights``, with ``ld_alpha``, ``f_divergence_type``,
``label_smoothing`` and ``use_weighting`` (WPO) as trl computes them. ``aot`` and ``aot_unpaired`` are refused: they
sort the log-ratios across the batch, so a row's loss depends on the other rows.

**Reference log-probabilities** are computed without gradient and never from the current policy: from
``precompute_ref_log_probs=True`` (trl computes them over the training set with the model as it is at construction,
before any step), or on the fly from ``ref_model`` — by default a frozen copy of the model as it is at construction
(trl would reload it from ``config._name_or_path``, which may not be these weights) — or, with PEFT, from the model with
its adapter disabled (trl's ``use_adapter``; a pretrained adapter's frozen copy ``"ref"`` when trl made one).

**The LM head.** trl computes log-probabilities with a fused head that multiplies the hidden states by
``lm_head.weight`` inside its own autograd function, so the head's module hooks never run and its per-example gradient
would escape clipping. The DP step never calls it: the model runs its ordinary forward (the fused head only runs when
``fused_lm_head=True`` is passed), so the head is a hooked layer like any other, and the log-probabilities are computed
from the model's logits (``log_softmax`` gathered at the labels, trl's shift and masks). Evaluation keeps trl's fused
path. The cost is the ``(2B, T, V)`` logits of a micro-batch in memory.

Refused with the reason: ``padding_free`` (trl 1.16's DPO turns it off with a warning; hf_dp refuses rather than
silently train otherwise), ``sync_ref_model`` (the reference would follow the policy), vision datasets, a
Mixture-of-Experts load-balancing loss (computed over the whole batch's tokens), activation (gradient) checkpointing
and offloading, and a ``ref_model`` that shares a parameter with the policy.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from trl import DPOConfig, DPOTrainer
from trl.trainer.utils import use_adapter

from .arguments import DPTrainingArguments, TrlOverridesUnderDP
from .losses import IGNORE_INDEX
from .peft_support import is_peft_model
from .preference import PreferencePairsDP, dp_config

__all__ = ["DPDPOConfig", "DPDPOTrainer", "ROW_WISE_LOSS_TYPES", "completion_log_probs"]

logger = logging.getLogger(__name__)

ROW_WISE_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                       "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
"""trl ``loss_type`` values whose loss on a row is a function of that row alone (exact per row under DP)."""
_BATCH_WISE_LOSS_TYPES = {"aot": "sorts the policy and reference log-ratios across the batch",
                          "aot_unpaired": "sorts the chosen and rejected log-ratios across the batch"}
_REF = "_hf_dp_ref_logps"  # per-sequence reference log-probs of a micro-batch (DPDPOTrainer.micro_batch_extras)


@dataclass
class DPDPOConfig(TrlOverridesUnderDP, DPOConfig, DPTrainingArguments):
    r"""Configuration of [`DPDPOTrainer`]: trl's `DPOConfig` plus every field of [`DPTrainingArguments`].

    Both sets of fields come from their own classes; both `__post_init__` validations run. trl's defaults are kept
    (`beta=0.1`, `loss_type=["sigmoid"]`, `learning_rate=1e-6`, `max_length=1024`, `disable_dropout=True`, ...),
    except:

    - (`gradient_checkpointing` keeps trl's `True`: exact under DP, with its memory saving;
      `clipping/checkpointing.py`.)
    - `bf16`: when not set, `True` only if `fp16` is not set **and** an accelerator is present.
    - `max_grad_norm`: `0.0` (DP clips per row with `per_sample_max_grad_norm`; see `DPTrainingArguments`).

    Refused: `loss_type` `"aot"` / `"aot_unpaired"` (batch-wise), `padding_free=True`, `sync_ref_model=True`,
    `activation_offloading=True`. `per_device_train_batch_size` and the expected batch count preference rows (each is
    two sequences).
    """

    def __post_init__(self):
        super().__post_init__()
        for loss_type in self.loss_type:
            if loss_type in _BATCH_WISE_LOSS_TYPES:
                raise ValueError(
                    f"loss_type={loss_type!r} {_BATCH_WISE_LOSS_TYPES[loss_type]}, so one row's loss depends on the "
                    "other rows of the batch and cannot be clipped per row under DP. Use a row-wise loss type: "
                    f"{', '.join(ROW_WISE_LOSS_TYPES)}."
                )
        if self.padding_free:
            raise ValueError(
                "padding_free=True: trl's DPOTrainer (1.16) has no padding-free path (it warns and pads instead); "
                "under DP hf_dp refuses rather than train otherwise than asked. Set padding_free=False."
            )
        if self.sync_ref_model:
            raise ValueError(
                "sync_ref_model=True mixes the policy into the reference model during training; DPDPOTrainer keeps "
                "the reference fixed (the model before training, precomputed or on the fly). Set sync_ref_model=False."
            )
        if self.activation_offloading:
            raise ValueError("activation_offloading is not supported under DP (untested with the per-example hooks).")


def completion_log_probs(logits: torch.Tensor, labels: torch.Tensor,
                         sum_sq: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of the next token, as trl's fused head computes them from the same logits.

    ``logits[:, t]`` scores ``labels[:, t + 1]``; positions whose target is ``-100`` (prompt, padding) are 0. Returns
    ``(log_probs, mask, log_sum_sq_probs)``, each ``(n, T - 1)``; the last (``log Σ_v p_v²``, for WPO weights) only
    with ``sum_sq``. Computed in float64 for float64 logits, else float32. A prompt-learning adapter (prompt tuning,
    P-tuning) prepends its virtual tokens to the logits: as trl (``log_probs[:, -seq_len:]``), the last ``T``
    positions are the real tokens.
    """
    extra = logits.shape[1] - labels.shape[1]
    if extra < 0:
        raise ValueError(f"The model returned logits for {logits.shape[1]} positions but the batch has "
                         f"{labels.shape[1]} tokens per sequence: the log-probabilities cannot be aligned with it.")
    logits = logits[:, extra:-1]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    # log p(target) = z_target − logsumexp(z): no second (n, T, V) tensor is kept for the backward pass
    lse = torch.logsumexp(logits, dim=-1)
    per_token = (logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) - lse).masked_fill(~mask, 0.0)
    sq = None
    if sum_sq:
        with torch.no_grad():
            sq = torch.logsumexp(2 * (logits - lse.unsqueeze(-1)), dim=-1).masked_fill(~mask, 0.0)
    return per_token, mask, sq


class _DPOTrainer(DPOTrainer):
    """``DPOTrainer`` taking its ``peft_config`` as ``trl_peft_config`` (``DPTrainer.__init__`` consumes a
    ``peft_config`` keyword itself; here trl applies the adapter, and keeps the adapter-disabled model as reference)."""

    def __init__(self, *args: Any, trl_peft_config: Any = None, **kwargs: Any):
        super().__init__(*args, peft_config=trl_peft_config, **kwargs)


class DPDPOTrainer(PreferencePairsDP, _DPOTrainer):
    """trl's ``DPOTrainer`` whose optimizer steps are DP-SGD / DP-Adam steps, one preference row as the privacy unit.

    Use it as ``DPOTrainer``, with :class:`DPDPOConfig`::

        args = DPDPOConfig(output_dir="out", target_epsilon=8.0, per_sample_max_grad_norm=1.0, beta=0.1,
                           per_device_train_batch_size=8, gradient_accumulation_steps=8, learning_rate=1e-4)
        trainer = DPDPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer,
                               peft_config=LoraConfig(...))
        trainer.train()

    Args:
        model, ref_model, args, *args, **kwargs: as for ``DPOTrainer`` (``args`` may also be
            ``DPTrainingArguments``). Without ``ref_model`` (full fine-tuning, reference log-probs not precomputed)
            the reference is a frozen copy of ``model`` as given.
        peft_config: a ``peft.PeftConfig``, applied by trl; only the adapter is trained, exactly; the reference is
            the model with the adapter disabled.

    See ``hf_dp/dpo.py`` for the unit, the losses, the reference and the LM head.
    """

    _name = "DP-DPO"
    _dp_compute_loss_is_not_trained = True  # trl's compute_loss (fused head, batch mean) serves evaluation only
    non_model_keys = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps", _REF})

    def compute_loss(self, *args: Any, **kwargs: Any):
        """trl's ``compute_loss``, used by evaluation only (a DP step clips each row's own loss)."""
        return super().compute_loss(*args, **kwargs)

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, *pargs: Any, peft_config: Any = None,
                 **kwargs: Any):
        if kwargs.get("per_example_loss") is not None:
            raise ValueError("DPDPOTrainer trains trl's DPO loss of each preference row; per_example_loss is not "
                             "accepted (choose the loss with loss_type / loss_weights).")
        args = dp_config(DPDPOConfig, args, "DPDPOTrainer")
        own_reference = (ref_model is None and not isinstance(model, str) and peft_config is None
                         and not is_peft_model(model) and not args.precompute_ref_log_probs)
        if own_reference:
            # The model as it is now, before any step: trl would reload it from config._name_or_path instead.
            ref_model = copy.deepcopy(model).requires_grad_(False).eval()
        self._reference: torch.Tensor | None = None
        super().__init__(model, ref_model, args, *pargs, trl_peft_config=peft_config, **kwargs)
        if self._is_vision_dataset:
            raise ValueError("Vision preference datasets are not supported by DPDPOTrainer yet (their collator "
                             "processes images per batch); train on text preference rows.")
        if self.aux_loss_enabled:
            raise ValueError(
                "This Mixture-of-Experts model adds a load-balancing loss computed over all the tokens of the batch, "
                "so one row's loss would depend on the other rows. Set router_aux_loss_coef=0.0 in DPDPOConfig."
            )
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            shared = {id(p) for p in reference.parameters()} & {id(p) for p in self.model.parameters()}
            if shared:
                raise ValueError(
                    f"ref_model shares {len(shared)} parameter tensor(s) with the model being trained, so the "
                    "reference would follow the policy as it trains. Pass an independent copy (or no ref_model: "
                    "DPDPOTrainer then copies the model before training)."
                )

    # ------------------------------------------------------------------ the rows
    def expected_sequences(self, feature: dict) -> tuple[list[int], list[int]]:
        """trl's ``DataCollatorForPreference``: prompt + completion, truncated to ``max_length`` per sequence."""
        chosen = list(feature["prompt_ids"]) + list(feature["chosen_ids"])
        rejected = list(feature["prompt_ids"]) + list(feature["rejected_ids"])
        n = self.args.max_length
        if n is not None:
            keep_end = self.args.truncation_mode == "keep_end"
            chosen, rejected = ((s[-n:] if keep_end else s[:n]) for s in (chosen, rejected))
        return chosen, rejected

    def pair_labels(self, batch: dict, num_rows: int) -> torch.Tensor:
        """The completion tokens (trl's labels: ``input_ids`` with ``-100`` outside ``completion_mask``)."""
        return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)

    @torch.no_grad()
    def micro_batch_extras(self, micro: dict, labels: torch.Tensor) -> dict:
        """The reference log-probs of the micro-batch's sequences (``(2m,)``), without gradient: precomputed (trl's
        columns), or from the reference model / the adapter-disabled model (never the current policy). Runs outside
        the engine's recording, so no hook sees the reference forward."""
        if self.precompute_ref_logps:
            if "ref_chosen_logps" not in micro or "ref_rejected_logps" not in micro:
                raise ValueError("precompute_ref_log_probs=True but the batch carries no reference log-probs.")
            return {_REF: torch.cat([micro["ref_chosen_logps"], micro["ref_rejected_logps"]]).to(labels.device)}
        inputs = {k: v for k, v in micro.items() if k not in self.non_model_keys}
        inputs["use_cache"] = False
        net = self.accelerator.unwrap_model(self.model)
        with self.compute_loss_context_manager():
            if self.ref_model is not None:
                logits = self.ref_model(**inputs).logits
            elif is_peft_model(net):
                with use_adapter(net, adapter_name="ref" if "ref" in net.peft_config else None):
                    logits = net(**inputs).logits
            else:  # pragma: no cover - __init__ always provides a reference
                raise RuntimeError("DPDPOTrainer has no reference model.")
        return {_REF: self._sequence_log_probs(logits, labels)[0].detach()}

    # ------------------------------------------------------------------ the loss of a row
    def _sequence_log_probs(self, logits: torch.Tensor, labels: torch.Tensor,
                            sum_sq: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Per sequence: trl's summed completion log-probs (``ld_alpha``-weighted beyond the shorter completion of
        the pair), with the per-token log-probs, shifted mask and (``sum_sq``) ``log Σ p²``."""
        per_token, mask, sq = completion_log_probs(logits, labels, sum_sq)
        if self.ld_alpha is None:
            return per_token.sum(1), per_token, mask, sq
        comp_pos = mask.long().cumsum(dim=1)
        chosen_lens, rejected_lens = mask.sum(dim=1).chunk(2, dim=0)
        shared_lens = torch.minimum(chosen_lens, rejected_lens).repeat(2)
        shared = (comp_pos > 0) & (comp_pos <= shared_lens.unsqueeze(1))
        tail = comp_pos > shared_lens.unsqueeze(1)
        return (per_token * shared).sum(1) + self.ld_alpha * (per_token * tail).sum(1), per_token, mask, sq

    def sequence_scores(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each sequence's summed completion log-probs (what the row's loss is a function of), for the first-step
        checks."""
        return completion_log_probs(outputs.logits, labels)[0].sum(1)

    def pair_losses(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """trl's ``DPOTrainer._compute_loss`` for each row alone (``(2m,)``: row ``r``'s loss at ``r``, 0 at
        ``m + r``), from the model's logits and the micro-batch's reference log-probs."""
        ref = self._reference
        self._reference = None
        if ref is None or ref.shape[0] != labels.shape[0]:
            raise RuntimeError("DPDPOTrainer: the reference log-probs of this micro-batch are missing.")
        logps, per_token, shift_mask, sq = self._sequence_log_probs(outputs.logits, labels, self.use_weighting)
        ref = ref.to(logps.dtype)
        chosen_logps, rejected_logps = logps.chunk(2)
        ref_chosen_logps, ref_rejected_logps = ref.chunk(2)
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        chosen_scores, rejected_scores = self._f_scores(chosen_logratios, rejected_logratios)
        delta_score = chosen_scores - rejected_scores
        completion_mask = labels != IGNORE_INDEX
        beta = self.beta
        total = torch.zeros_like(chosen_logps)
        for loss_type, loss_weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sigmoid":
                loss = -F.logsigmoid(beta * delta_score)
            elif loss_type == "hinge":
                loss = torch.relu(1 - beta * delta_score)
            elif loss_type in ("ipo", "sigmoid_norm"):
                chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
                delta = (chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
                         - rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0))
                loss = (delta - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * delta)
            elif loss_type == "exo_pair":
                epsilon = torch.tensor(self.label_smoothing, device=delta_score.device)  # as trl (default dtype)
                loss = (torch.sigmoid(beta * delta_score) * (F.logsigmoid(beta * delta_score) - torch.log1p(-epsilon))
                        + torch.sigmoid(-beta * delta_score) * (F.logsigmoid(-beta * delta_score)
                                                                - torch.log(epsilon)))
            elif loss_type == "nca_pair":
                chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
                loss = (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                        - 0.5 * F.logsigmoid(-rejected_rewards))
            elif loss_type == "robust":
                s = self.label_smoothing
                loss = ((-(1 - s) * F.logsigmoid(beta * delta_score) + s * F.logsigmoid(-beta * delta_score))
                        / (1 - 2 * s))
            elif loss_type == "bco_pair":
                loss = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
            elif loss_type == "sppo_hard":
                loss = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
            elif loss_type == "apo_zero":
                loss = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
            elif loss_type == "apo_down":
                loss = (torch.sigmoid(beta * chosen_logratios)
                        + 1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios)))
            elif loss_type == "discopop":
                logits = delta_score * beta
                modulation = torch.sigmoid(logits / self.args.discopop_tau)
                loss = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
            elif loss_type == "sft":  # trl: the mean over the batch's chosen tokens; on one row, over its own
                chosen_mask = shift_mask.chunk(2, dim=0)[0]
                chosen_tokens = per_token.chunk(2, dim=0)[0]
                loss = -(chosen_tokens * chosen_mask).sum(1) / chosen_mask.sum(1)
            else:
                raise ValueError(f"loss_type={loss_type!r} is not supported by DPDPOTrainer (row-wise loss types: "
                                 f"{', '.join(ROW_WISE_LOSS_TYPES)}).")
            if self.use_weighting:  # WPO (Zhou et al. 2024, eq. 2), weights without gradient as trl
                with torch.no_grad():
                    lengths = shift_mask.sum(dim=1).clamp_min(1)
                    weights = torch.exp(((per_token - sq) * shift_mask).sum(dim=1) / lengths)
                    chosen_weights, rejected_weights = weights.chunk(2, dim=0)
                loss = loss * chosen_weights * rejected_weights
            total = total + loss * loss_weight
        return torch.cat([total, torch.zeros_like(total.detach())])

    def _f_scores(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """trl's f-divergence scores of the log-ratios (Wang et al. 2023, f-DPO)."""
        kind = self.f_divergence_type
        if kind == "reverse_kl":
            return chosen, rejected
        if kind == "forward_kl":
            return 1 - torch.exp(-chosen), 1 - torch.exp(-rejected)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(chosen), math.log(2) + F.logsigmoid(rejected)
        if kind == "alpha_divergence":
            alpha = self.f_alpha_divergence_coef
            if abs(alpha - 1.0) < 1e-6:
                return chosen, rejected
            coef = 1.0 / (alpha - 1.0)
            t_chosen, t_rejected = (alpha - 1.0) * chosen, (alpha - 1.0) * rejected
            clamp_max = {torch.float16: 11.0}.get(t_chosen.dtype, 80.0)
            return ((torch.exp(torch.clamp(t_chosen.float() if t_chosen.dtype != torch.float64 else t_chosen,
                                           max=clamp_max)) - 1.0).to(t_chosen.dtype) * coef,
                    (torch.exp(torch.clamp(t_rejected.float() if t_rejected.dtype != torch.float64 else t_rejected,
                                           max=clamp_max)) - 1.0).to(t_rejected.dtype) * coef)
        raise ValueError(f"Unknown f_divergence_type: {kind}")

    def _model_inputs(self, model, inputs: dict, labels: torch.Tensor) -> dict:
        """The model's inputs; the micro-batch's reference log-probs are kept for :meth:`pair_losses`, which the DP
        step calls on this forward's outputs."""
        self._reference = inputs.get(_REF)
        return super()._model_inputs(model, inputs, labels)
