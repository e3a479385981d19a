"""``DPTrainingArguments``: ``TrainingArguments`` plus the privacy fields, in the style of trl's configs.

Every field has ``metadata={"help": ...}`` so ``HfArgumentParser`` renders it on the command line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from .clipping.modes import ADAPTIVE_AUTOMATIC_REFUSAL, CLIPPING_FUNCTIONS
from .clipping.two_pass import FLAT_CLIPPING_PASSES
from .guarantee import check_mixed_precision, check_noise_std

logger = logging.getLogger(__name__)

__all__ = ["DPTrainingArguments", "CLIPPING_MODES", "NotPrivateWarning"]

CLIPPING_MODES = ("flat", "per_layer", "adaptive_per_layer", "group_wise", "per_device")
NOISE_ALLOCATIONS = ("global", "equal_budget", "weighted")
ACCOUNTANTS = ("prv", "rdp")


def _has_accelerator() -> bool:
    """Whether torch sees any accelerator (CUDA, ROCm, MPS, XPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


class NotPrivateWarning(UserWarning):
    """A setting under which training is not differentially private (or not as private as reported)."""


@dataclass
class DPTrainingArguments(TrainingArguments):
    r"""Arguments for [`DPTrainer`]: every optimizer step is one DP-SGD / DP-Adam step.

    > Privacy budget (give exactly one of `target_epsilon` and `noise_multiplier`)

    Parameters:
        target_epsilon (`float`, *optional*):
            The ε of the (ε, δ)-DP guarantee for the whole run. The noise multiplier is calibrated so that the exact
            number of optimizer steps the Trainer will run spends at most this budget; training stops (and saves)
            before a step that would exceed it.
        target_delta (`float`, *optional*):
            The δ of the guarantee. Defaults to ``1 / N**1.1`` for a training set of N examples (below 1/N).
        noise_multiplier (`float`, *optional*):
            σ: noise std divided by the L2 sensitivity. ε is then reported, not targeted. σ = 0 is allowed for
            testing only and is NOT private.

    > Clipping and sampling

    Parameters:
        per_sample_max_grad_norm (`float`, defaults to 0.1):
            C: every example's gradient is clipped to L2 norm C (Li et al. 2022, §3.1 recommend a small C).
        clipping (`str`, defaults to `"flat"`):
            How per-example gradients are clipped: `"flat"` (one norm over all trainable parameters, threshold C);
            `"per_layer"` (each layer its own threshold C_k, clipped inside the backward pass, He et al. 2023 §3.1);
            `"adaptive_per_layer"` (per-layer thresholds that track a private quantile of the norms, Alg. 1);
            `"group_wise"` (groups named by `clipping_groups` patterns); `"per_device"` (one group per device, §4).
        clipping_function (`str`, defaults to `"clip"`):
            How an example's (user's, packed segment's) gradient is scaled: `"clip"`, by min(1, C/‖g‖) (Abadi et al.
            2016); `"automatic"`, by C/(‖g‖ + γ) (Bu et al., NeurIPS 2023, AUTO-S): every gradient is normalised to
            norm just below C, so the sensitivity is still C and noise and ε are unchanged; C then only scales the
            update like the learning rate. In group-wise modes each group k is scaled by C_k/(‖g_k‖ + γ). Not with
            `clipping="adaptive_per_layer"` (no example is unclipped, so its quantile would only set step sizes).
        automatic_clipping_gamma (`float`, defaults to 0.01):
            γ > 0 of automatic clipping: the stability constant in C/(‖g‖ + γ); the smaller γ, the closer every
            scaled gradient's norm is to C (a gradient with ‖g‖ ≪ γ gets norm ≈ C‖g‖/γ ≪ C).
        lm_loss_chunk_size (`int`, *optional*):
            Causal LMs (the default next-token loss, DP-SFT's loss): each example's loss is computed with the LM head
            applied to this many positions at a time and recomputed in the backward, so the batch × length ×
            vocabulary logits and their float32 copies are never held whole (`hf_dp/chunked_loss.py`). Exact (the
            head's per-example norm includes the cross terms between chunks) and checked against the model's own
            loss before the first update. DP-SFT packed or not. Not under FSDP or with a prompt-learning adapter.
            Default: off.
        flat_clipping_passes (`str`, defaults to `"auto"`):
            How flat clipping forms the clipped sum (one device, DDP): `"one"`, book-keeping (one forward and backward;
            every layer's input and output gradient kept to the end of the backward); `"two"`, two passes (Li et al.
            2022, §4): per-example norms in the recorded backward, each layer's factors dropped as soon as its norm is
            computed, then a second forward (same dropout masks) and an ordinary backward of Σ c_i L_i — about one
            more forward and backward, but activation checkpointing keeps its memory saving; `"auto"`: `"two"` when
            activation checkpointing is on (`gradient_checkpointing=True`, or turned on on the model or on a
            transformers model inside it), else `"one"`. The same under DDP; FSDP is always two-pass (`"one"` is
            refused there).
            Only for `clipping="flat"` (per-layer modes clip inside the backward already).
        clipping_groups, group_max_grad_norms, noise_allocation:
            Groups (for `group_wise`), thresholds C_k (default C/√K each, App. A.1) and how noise is spread over
            groups (`global`: same std everywhere; `equal_budget`: std ∝ C_k; `weighted`: std ∝ C_k/√d_k; §3.3).
        target_quantile, quantile_lr, quantile_budget_fraction, quantile_noise_multiplier, adaptive_rescale_to_global:
            Adaptive clipping (Alg. 1): target quantile q, step η (0.3), budget fraction r for the clip counts (0.01)
            or their noise σ_b directly; optionally rescale thresholds to ‖C‖ = C after each update (App. A.1).
        poisson_sampling (`bool`, defaults to `True`):
            Poisson sampling (each example in each step's batch independently with probability q), as the accountant
            assumes. `False` uses fixed-size shuffled batches, whose ε is then only heuristic (logged and recorded).
        accountant (`str`, defaults to `"prv"`):
            `"prv"` (privacy random variables, Gopi et al. 2021; the upper bound is reported) or `"rdp"`. Where
            prv-accountant fails numerically (small σ at large q), ε comes from the pessimistic PLD of `dp-accounting`
            (a tight upper bound); the logs, `privacy_spent()` and `dp_state.json` name it (`accountant_used`).
        accountant_eps_error (`float`, defaults to 0.01):
            Precision of the PRV accountant (its upper bound is ~ this above its estimate; the PLD fallback uses a
            grid of a tenth of it).
        dp_seed (`int`, *optional*):
            Seed of the Poisson sampler and the noise. By default a secret seed is drawn from the OS, as the guarantee
            requires; a fixed seed makes runs reproducible but voids the guarantee against anyone who knows it.

        secure_mode (`bool`, defaults to `False`):
            Draw each step's noise from a generator seeded with fresh OS entropy (never stored) and combine four
            Gaussian draws per coordinate against floating-point attacks (Holohan & Braghin 2021 §5.1, as Opacus'
            `secure_mode`); about four times the cost of drawing the noise. See `hf_dp.noise.NoiseGenerator` for the
            threat model. Refused together with `dp_seed`.
        eval_data_is_public (`bool`, defaults to `False`):
            Declares that the evaluation data is public or held out, not private training data. Only then do the
            evaluation results go into the model card (`model-index`) and into the `trainer_state.json` pushed to
            the Hub; the card says that the evaluation data is not covered by the guarantee.

        dp_self_check (`bool`, defaults to `True`):
            The expensive part of the first step's checks: two examples' gradient norms in a micro-batch of at least
            two must equal their norms alone, in eval mode and in train mode with dropout off (catches anything that
            mixes examples: batch statistics, attention across the batch). Costs two extra forward/backward passes of
            the micro-batch and four single-example ones, once. Turning it off never turns off coverage: the static
            check (every module owning a trainable parameter has a rule or the exact fallback), the proof of every
            layer's batch axis and the comparison of the hooks' sum with autograd's gradient on two examples always
            run.

    > DP-Adam bias correction

    Parameters:
        dp_adam_bias_correction (`bool`, defaults to `False`):
            DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024, Alg. 1): Adam's second-moment estimate v̂ is corrected
            for the known variance Φ = (σ·C / (q·N))² per coordinate of the noise in each released gradient (the
            group's noise std with group-wise clipping), `sqrt(max(v̂ − Φ, γ′))` replacing `sqrt(v̂) + ε` in the
            update. Post-processing of the released gradients with the public σ, C, q, N: no privacy cost. For the
            Trainer's Adam-family `optim` choices (`adamw_torch`, `adamw_torch_fused`, `adamw_hf`, ...) and a
            `torch.optim.AdamW` / `Adam` passed with `optimizers=`; other optimizers are refused. With σ = 0 it is
            plain AdamW.
        dp_adam_bc_epsilon (`float`, defaults to 1e-8):
            γ′ of DP-AdamBC: the floor of the corrected second moment, `max(v̂ − Φ, γ′)`; it replaces Adam's ε.

    > Privacy unit

    Parameters:
        privacy_unit (`str`, defaults to `"example"`):
            `"user"`: users (rows sharing `user_id_column`) are Poisson-sampled and each user's whole contribution
            (`user_contribution`: the mean or sum of their examples' gradients, at most `max_examples_per_user`
            examples per step) is clipped as one unit, so ε is a user-level guarantee. The expected batch size then
            counts users, and q = expected users per step / number of users.

    The expected logical batch size is `per_device_train_batch_size × gradient_accumulation_steps × world_size`, so
    the sampling rate is q = that / N. `per_device_train_batch_size` only bounds memory: a Poisson batch larger than
    expected is split into more micro-batches, never truncated. The Trainer's own `max_grad_norm` (clipping of the
    already-noised gradient) defaults to 0 (off). `fp16=True` is refused (its loss scaler would divide the noised
    gradient); `bf16=True` is supported.
    """

    target_epsilon: float | None = field(
        default=None, metadata={"help": "Target ε of the (ε, δ)-DP guarantee for the whole run (calibrates σ)."}
    )
    target_delta: float | None = field(
        default=None, metadata={"help": "δ of the guarantee. Default: 1/N^1.1 for N training examples."}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "σ (noise std / sensitivity); give this or target_epsilon, not both."}
    )
    per_sample_max_grad_norm: float = field(
        default=0.1, metadata={"help": "C: L2 clipping threshold of each example's gradient."}
    )
    clipping: str = field(default="flat", metadata={"help": f"Clipping mode, one of {CLIPPING_MODES}."})
    clipping_function: str = field(
        default="clip",
        metadata={"help": f"One of {CLIPPING_FUNCTIONS}: 'clip' scales each example's gradient by min(1, C/‖g‖); "
                          "'automatic' by C/(‖g‖+γ) (Bu et al. 2023), every gradient normalised; sensitivity C "
                          "either way (per group C_k in group-wise modes)."},
    )
    automatic_clipping_gamma: float = field(
        default=0.01, metadata={"help": "γ > 0 of automatic clipping's C/(‖g‖+γ)."}
    )
    flat_clipping_passes: str = field(
        default="auto",
        metadata={"help": f"One of {FLAT_CLIPPING_PASSES}, for clipping='flat' (one device or DDP): 'one' book-keeping "
                          "(factors kept to the end of the backward), 'two' norms then a second forward and backward "
                          "of the reweighted loss (keeps activation checkpointing's memory saving, costs about one "
                          "more forward and backward), 'auto' two with activation checkpointing on, else one."},
    )
    clipping_groups: list[str] | None = field(
        default=None,
        metadata={"help": "For clipping='group_wise': regular expressions on parameter names, one group each "
                          "(first match wins; unmatched parameters form a group 'other')."},
    )
    group_max_grad_norms: list[float] | None = field(
        default=None,
        metadata={"help": "Per-group thresholds C_k, in group order. Default: C/sqrt(K) each (He et al. App. A.1)."},
    )
    noise_allocation: str | None = field(
        default=None,
        metadata={"help": f"Group-wise noise allocation, one of {NOISE_ALLOCATIONS}. Default: global "
                          "(equal_budget for per_device)."},
    )
    target_quantile: float = field(
        default=0.5, metadata={"help": "Adaptive clipping: target fraction of unclipped examples per group."}
    )
    quantile_lr: float = field(default=0.3, metadata={"help": "Adaptive clipping: η of C_k ← C_k exp(−η(b̃−q))."})
    quantile_budget_fraction: float = field(
        default=0.01, metadata={"help": "Adaptive clipping: fraction r of the budget spent on the clip counts."}
    )
    quantile_noise_multiplier: float | None = field(
        default=None, metadata={"help": "Adaptive clipping: σ_b for the clip counts instead of deriving it from r."}
    )
    adaptive_rescale_to_global: bool = field(
        default=False,
        metadata={"help": "Adaptive clipping: rescale thresholds so that ‖(C_1..C_K)‖ = C after each update."},
    )
    privacy_unit: str = field(
        default="example",
        metadata={"help": "'example' (each row) or 'user' (all rows sharing `user_id_column`): what ε protects."},
    )
    user_id_column: str | None = field(
        default=None, metadata={"help": "For privacy_unit='user': the dataset column that identifies the user."}
    )
    max_examples_per_user: int | None = field(
        default=None, metadata={"help": "For privacy_unit='user': at most this many of a user's examples per step."}
    )
    user_contribution: str = field(
        default="mean",
        metadata={"help": "For privacy_unit='user': clip the 'mean' or the 'sum' of a user's example gradients."},
    )
    dp_adam_bias_correction: bool = field(
        default=False,
        metadata={"help": "DP-AdamBC (Tang et al. 2024): subtract the known noise variance (σC/(qN))² from Adam's "
                          "second moment, floored at dp_adam_bc_epsilon. Adam-family optimizers only; no privacy "
                          "cost."},
    )
    dp_adam_bc_epsilon: float = field(
        default=1e-8, metadata={"help": "γ′ of DP-AdamBC: the floor of Adam's corrected second moment."}
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={"help": "Poisson sampling as the accountant assumes (False: shuffled fixed batches, heuristic ε)."},
    )
    accountant: str = field(default="prv", metadata={"help": f"Privacy accountant, one of {ACCOUNTANTS}."})
    dp_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of sampling and noise. Default: secret (OS). A known seed voids the guarantee."},
    )
    dp_self_check: bool = field(
        default=True,
        metadata={"help": "At the first step, also compare two examples' gradient norms in a micro-batch with their "
                          "norms alone (train and eval mode). Coverage checks (static, batch axes, hooks vs autograd) "
                          "always run."},
    )
    lm_loss_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Causal LMs: compute each example's next-token loss with the LM head applied to this many "
                          "positions at a time, recomputed in the backward, so the (batch x length x vocabulary) "
                          "logits are never held whole (large vocabularies). Exact; checked against the model's own "
                          "loss at the first step. Default: off (the model's full logits)."},
    )
    max_grad_norm: float = field(
        default=0.0,
        metadata={"help": "Global clipping of the already-privatized gradient (post-processing). Off by default. "
                          "NOT the per-example clipping norm C: that is --per_sample_max_grad_norm."},
    )
    accountant_eps_error: float = field(
        default=0.01,
        metadata={"help": "Precision of the PRV accountant: its reported upper bound is ~ this above the estimate."},
    )
    secure_mode: bool = field(
        default=False,
        metadata={"help": "Noise from fresh OS entropy at every step, with the floating-point-attack mitigation "
                          "(4 Gaussian draws per coordinate, as Opacus' secure_mode). Incompatible with dp_seed."},
    )
    eval_data_is_public: bool = field(
        default=False,
        metadata={"help": "Declare the evaluation data public or held out (not private training data): evaluation "
                          "results then go into the model card's model-index and the pushed trainer_state.json."},
    )

    def _check_finite(self) -> None:
        """Every privacy number must be a finite number: σ = ∞ or C = ∞ would be accepted by the range checks
        below and train to non-finite weights (or without clipping) while ε is reported."""
        scalars = {
            "target_epsilon": self.target_epsilon, "target_delta": self.target_delta,
            "noise_multiplier": self.noise_multiplier, "per_sample_max_grad_norm": self.per_sample_max_grad_norm,
            "target_quantile": self.target_quantile, "quantile_lr": self.quantile_lr,
            "quantile_budget_fraction": self.quantile_budget_fraction,
            "quantile_noise_multiplier": self.quantile_noise_multiplier,
            "automatic_clipping_gamma": self.automatic_clipping_gamma, "dp_adam_bc_epsilon": self.dp_adam_bc_epsilon,
        }
        for name, value in scalars.items():
            if value is not None and not math.isfinite(float(value)):
                raise ValueError(f"{name} must be a finite number, got {value}.")
        if self.group_max_grad_norms is not None and not all(math.isfinite(float(c))
                                                             for c in self.group_max_grad_norms):
            raise ValueError(f"group_max_grad_norms must all be finite numbers, got {self.group_max_grad_norms}.")
        if self.noise_multiplier is not None:
            check_noise_std(self.noise_multiplier, self.per_sample_max_grad_norm)

    def __post_init__(self):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not self.use_cpu and not _has_accelerator():
            # `torchrun` / `accelerate launch --multi_gpu` on a machine without any accelerator: without use_cpu,
            # transformers would run every process alone on all the data (DPTrainer refuses that); with it, the
            # processes form one gloo job, which is what was launched.
            logger.info("hf_dp: %s processes launched, no accelerator: use_cpu=True (gloo).", os.environ["WORLD_SIZE"])
            self.use_cpu = True
        if self.fp16:
            # Checked before TrainingArguments.__post_init__, which may refuse fp16 on CPU with an unrelated message.
            raise ValueError(
                "fp16=True is not supported by DPTrainer: accelerate's GradScaler divides the gradient in `.grad` by "
                "its loss scale (65,536 at first) before the optimizer step, and DPTrainer writes the already noised "
                "and normalised gradient there, so the model would barely train while ε is spent. Use bf16=True "
                "(no loss scaling) or full precision (fp32)."
            )
        numbers_from_text(self)  # a YAML config's `1e-5` is a string
        self._check_finite()
        super().__post_init__()
        check_mixed_precision(self)  # from ACCELERATE_MIXED_PRECISION, read by TrainingArguments
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "Give exactly one of `target_epsilon` (σ is calibrated to it) and `noise_multiplier` (ε is reported); "
                f"got target_epsilon={self.target_epsilon}, noise_multiplier={self.noise_multiplier}."
            )
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon}.")
        if self.noise_multiplier is not None:
            if self.noise_multiplier < 0:
                raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}.")
            if self.noise_multiplier == 0:
                warnings.warn(
                    "noise_multiplier=0: training is NOT differentially private (no noise); use it only for tests.",
                    NotPrivateWarning,
                    stacklevel=2,
                )
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {self.target_delta}.")
        if not self.per_sample_max_grad_norm > 0:
            raise ValueError(f"per_sample_max_grad_norm (C) must be > 0, got {self.per_sample_max_grad_norm}.")
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {self.clipping!r}.")
        if self.clipping == "group_wise" and not self.clipping_groups:
            raise ValueError("clipping='group_wise' needs clipping_groups (parameter-name patterns, one per group).")
        if self.clipping_function not in CLIPPING_FUNCTIONS:
            raise ValueError(f"clipping_function must be one of {CLIPPING_FUNCTIONS}, got {self.clipping_function!r}.")
        if self.clipping_function == "automatic" and self.clipping == "adaptive_per_layer":
            raise ValueError(ADAPTIVE_AUTOMATIC_REFUSAL)
        if not self.automatic_clipping_gamma > 0:
            raise ValueError(f"automatic_clipping_gamma (γ) must be > 0, got {self.automatic_clipping_gamma}.")
        if self.flat_clipping_passes not in FLAT_CLIPPING_PASSES:
            raise ValueError(f"flat_clipping_passes must be one of {FLAT_CLIPPING_PASSES}, got "
                             f"{self.flat_clipping_passes!r}.")
        if self.flat_clipping_passes != "auto" and self.clipping != "flat":
            raise ValueError(
                f"flat_clipping_passes={self.flat_clipping_passes!r} applies to clipping='flat' only; clipping="
                f"{self.clipping!r} clips each group inside the backward pass (one pass, its factors freed as it "
                "goes). Leave flat_clipping_passes='auto'.")
        if not self.dp_adam_bc_epsilon > 0:
            raise ValueError(f"dp_adam_bc_epsilon (γ′) must be > 0, got {self.dp_adam_bc_epsilon}.")
        if self.lm_loss_chunk_size is not None and (isinstance(self.lm_loss_chunk_size, bool)
                                                    or int(self.lm_loss_chunk_size) != self.lm_loss_chunk_size
                                                    or self.lm_loss_chunk_size < 1):
            raise ValueError(f"lm_loss_chunk_size must be a positive number of positions (or None: off), got "
                             f"{self.lm_loss_chunk_size!r}.")
        if self.dp_adam_bias_correction and self.max_grad_norm > 0:
            raise ValueError(
                f"dp_adam_bias_correction=True with max_grad_norm={self.max_grad_norm}: the Trainer's global clipping "
                "rescales the released gradient by a factor that depends on it, so the noise variance in it is no "
                "longer the known (σ·C/(q·N))² that DP-AdamBC subtracts. Set max_grad_norm=0 (the default)."
            )
        if self.noise_allocation is not None and self.noise_allocation not in NOISE_ALLOCATIONS:
            raise ValueError(f"noise_allocation must be one of {NOISE_ALLOCATIONS}, got {self.noise_allocation!r}.")
        if self.noise_allocation not in (None, "global") and self.clipping == "flat":
            raise ValueError("noise_allocation applies to group-wise clipping modes, not to clipping='flat'.")
        if self.group_max_grad_norms is not None and any(not c > 0 for c in self.group_max_grad_norms):
            raise ValueError(f"group_max_grad_norms must all be > 0, got {self.group_max_grad_norms}.")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}.")
        if not self.quantile_lr > 0:
            raise ValueError(f"quantile_lr must be > 0, got {self.quantile_lr}.")
        if not 0 < self.quantile_budget_fraction < 1:
            raise ValueError(f"quantile_budget_fraction must be in (0, 1), got {self.quantile_budget_fraction}.")
        if self.quantile_noise_multiplier is not None and not self.quantile_noise_multiplier > 0:
            raise ValueError(f"quantile_noise_multiplier must be > 0, got {self.quantile_noise_multiplier}.")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}.")
        if self.privacy_unit not in ("example", "user"):
            raise ValueError(f"privacy_unit must be 'example' or 'user', got {self.privacy_unit!r}.")
        if self.privacy_unit == "user":
            if not self.user_id_column:
                raise ValueError("privacy_unit='user' needs user_id_column (the column identifying each user).")
            if not self.poisson_sampling:
                raise ValueError("privacy_unit='user' needs poisson_sampling=True (Poisson sampling of users).")
        if self.user_contribution not in ("mean", "sum"):
            raise ValueError(f"user_contribution must be 'mean' or 'sum', got {self.user_contribution!r}.")
        if self.max_examples_per_user is not None and self.max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be >= 1, got {self.max_examples_per_user}.")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}.")
        if self.max_grad_norm > 0:
            warnings.warn(
                f"max_grad_norm={self.max_grad_norm} clips the already-noised update (the Trainer's global clipping; "
                "post-processing, it changes neither the noise nor ε). The per-example clipping norm C is "
                f"per_sample_max_grad_norm (now {self.per_sample_max_grad_norm}); Opacus calls C `max_grad_norm`. "
                "If you meant C, pass per_sample_max_grad_norm instead and leave max_grad_norm at 0.",
                UserWarning,
                stacklevel=2,
            )
        if not (math.isfinite(self.accountant_eps_error) and self.accountant_eps_error > 0):
            raise ValueError(f"accountant_eps_error must be a finite number > 0, got {self.accountant_eps_error}.")
        if self.label_smoothing_factor and self.lm_loss_chunk_size:
            raise ValueError(
                f"label_smoothing_factor={self.label_smoothing_factor} with lm_loss_chunk_size: the chunked LM head "
                "computes only each token's cross-entropy with its target, not the mean of -log p over the "
                "vocabulary that label smoothing adds. Set lm_loss_chunk_size=None (or label_smoothing_factor=0).")
        if not self.poisson_sampling:
            warnings.warn(
                "poisson_sampling=False: fixed-size shuffled batches do not match the Poisson-subsampling analysis; "
                "the reported ε is heuristic, and the model card will say so.",
                NotPrivateWarning,
                stacklevel=2,
            )
        if self.lr_scheduler_type == "reduce_lr_on_plateau":
            warnings.warn(
                "lr_scheduler_type='reduce_lr_on_plateau' lowers the learning rate by evaluation metrics. If the "
                "evaluation set is private data, that use of it is not covered by the DP guarantee.",
                NotPrivateWarning,
                stacklevel=2,
            )
        if self.load_best_model_at_end or self.save_strategy == "best":
            what = "load_best_model_at_end" if self.load_best_model_at_end else "save_strategy='best'"
            warnings.warn(
                f"{what} selects a checkpoint by evaluation metrics. If the evaluation set is private data, that "
                "selection is not covered by the DP guarantee.",
                NotPrivateWarning,
                stacklevel=2,
            )
        # Secure noise (noise.py, NoiseGenerator): fresh OS entropy at every step, so no seed can be given.
        if self.secure_mode and self.dp_seed is not None:
            raise ValueError(
                "secure_mode=True seeds every step's noise from fresh OS entropy; it cannot be combined with "
                f"dp_seed={self.dp_seed}. Drop dp_seed (or secure_mode, for a reproducible, non-secure run)."
            )


_DP_MAX_GRAD_NORM = DPTrainingArguments.__dataclass_fields__["max_grad_norm"]


def numbers_from_text(args: DPTrainingArguments) -> None:
    """The privacy numbers given as text, converted as the command line converts them (``float(text)``).

    ``HfArgumentParser.parse_yaml_file`` / ``parse_dict`` pass values as the file holds them, and YAML 1.1 reads
    ``1e-5`` (no decimal point) as the *string* ``"1e-5"``: ``target_delta: 1e-5`` reached the range checks as text and
    failed there with Python's bare ``TypeError: '<' not supported between instances of 'int' and 'str'``. Every
    float field hf_dp adds (and each entry of a list of floats) that holds text is converted; text that is not a
    number is refused naming the field."""
    own = {f.name for f in dataclasses.fields(TrainingArguments)} - {"max_grad_norm"}

    def number(name: str, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number; give it as a number (e.g. 1.0e-5).") from None

    for f in dataclasses.fields(DPTrainingArguments):  # hf_dp's own fields (a trl config's are trl's business)
        if f.name in own or "float" not in str(f.type):
            continue
        value = getattr(args, f.name)
        if isinstance(value, (list, tuple)):
            setattr(args, f.name, [number(f.name, v) for v in value])
        else:
            setattr(args, f.name, number(f.name, value))


@dataclass
class TrlOverridesUnderDP:
    """The defaults of trl's configs (``trl/trainer/base_config.py``) that DP training changes, written once for every
    trl config pair (``DPSFTConfig``, ``DPDPOConfig``, ``DPRewardConfig``). Listed first among a config's bases, its
    fields win over trl's: ``bf16`` on only with an accelerator and without ``fp16`` (trl: on unless fp16),
    ``max_grad_norm`` as ``DPTrainingArguments`` has it (without this field the trl side of the hierarchy, which
    re-lists TrainingArguments' fields, restores 1.0). trl's ``gradient_checkpointing=True`` stays: activation
    checkpointing keeps its memory saving under DP (``clipping/checkpointing.py``)."""

    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Default: True if fp16 is not set and an accelerator is present."},
    )
    max_grad_norm: float = field(default=_DP_MAX_GRAD_NORM.default, metadata=_DP_MAX_GRAD_NORM.metadata)

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _has_accelerator()
        super().__post_init__()
