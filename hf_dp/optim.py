"""DP-AdamBC: Adam whose second moment is corrected for the known variance of the DP noise.

Tang, Shpilevskiy, Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)",
AAAI 2024, Alg. 1. In DP-Adam the released gradient is ``g̃ = ḡ + z`` with ``z ~ N(0, Φ I)``,
``Φ = (σ·C / (q·N))²`` per coordinate (σ the noise multiplier, C the clipping norm, q·N the expected batch size; with
group-wise noise each group's own std). Adam's second-moment estimate then tracks ``E[g̃²] = ḡ² + Φ``, and for small
gradients ``√v̂ ≈ √Φ`` is the same for every coordinate, so the update is that of DP-SGD with momentum. DP-AdamBC
subtracts the known Φ::

    m_t = β₁ m_{t−1} + (1 − β₁) g̃_t            m̂_t = m_t / (1 − β₁ᵗ)
    v_t = β₂ v_{t−1} + (1 − β₂) g̃_t²           v̂_t = v_t / (1 − β₂ᵗ)
    θ_t = θ_{t−1} − η · m̂_t / √max(v̂_t − Φ, γ′)

with γ′ (``dp_adam_bc_epsilon``) a floor that replaces Adam's ε. Decoupled weight decay (AdamW) multiplies θ by
``1 − η·λ`` first, as ``torch.optim.AdamW`` does; ``torch.optim.Adam``'s coupled L2 decay adds ``λθ`` to g̃ (a public,
deterministic shift: Φ is unchanged). The correction reads only the released gradients and the public σ, C, q, N:
post-processing, no privacy cost. With Φ = 0 (σ = 0) there is nothing to correct and the step is
``torch.optim.AdamW.step`` itself (``√v̂ + ε``), exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["DPAdamBC", "ADAM_BC_OPTIMS", "bias_corrected_adam", "check_adam_bc_optim"]

ADAM_BC_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""``TrainingArguments.optim`` values for which the Trainer builds a ``torch.optim.AdamW`` (DP-AdamBC rebuilds it)."""

NoiseStd = float | Mapping[int, float] | Callable[[], "float | Mapping[int, float]"]


class DPAdamBC(torch.optim.AdamW):
    """AdamW with DP-AdamBC's bias-corrected second moment (Tang et al. 2024, Alg. 1).

    Args:
        params, lr, betas, eps, weight_decay, **kwargs: as ``torch.optim.AdamW`` (``eps`` is used only when the noise
            std is 0, where the step is AdamW's own).
        noise_std: the std of the DP noise in each coordinate of the released gradient ``p.grad`` (``σ·C / (q·N)``;
            the group's std with group-wise noise): a float, a mapping ``{id(param): std}``, or a zero-argument
            callable returning either (read at every step: ``DPTrainer`` calibrates σ at train start).
        gamma: γ′, the floor of the corrected second moment ``max(v̂ − Φ, γ′)``.

    A parameter group with ``decoupled_weight_decay=False`` (one taken over from a ``torch.optim.Adam``) adds its L2
    decay to the gradient, as Adam does.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, noise_std: NoiseStd = 0.0, gamma: float = 1e-8, **kwargs: Any):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(flag):
                raise ValueError(f"DPAdamBC (Tang et al. 2024, Alg. 1) has no {flag}=True variant.")
        if not (math.isfinite(gamma) and gamma > 0):
            raise ValueError(f"DPAdamBC needs a floor γ′ > 0 (dp_adam_bc_epsilon), got {gamma}.")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        self.noise_std = noise_std
        self.gamma = float(gamma)

    def _noise_std_lookup(self) -> Callable[[torch.Tensor], float] | None:
        """``p -> std of the noise in p.grad``; ``None`` when every std is 0 (then the step is AdamW's)."""
        value = self.noise_std() if callable(self.noise_std) else self.noise_std
        if isinstance(value, Mapping):
            if not any(float(s) > 0 for s in value.values()):
                return None

            def lookup(p: torch.Tensor) -> float:
                if id(p) not in value:
                    raise ValueError(
                        f"DPAdamBC: no DP noise std is known for a parameter of shape {tuple(p.shape)} that has a "
                        "gradient; every parameter the optimizer updates must be one the DP step releases."
                    )
                return float(value[id(p)])

            return lookup
        std = float(value)
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"DPAdamBC: the noise std must be a finite number >= 0, got {std}.")
        return None if std == 0 else (lambda p: std)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of Alg. 1 (or, with zero noise, ``torch.optim.AdamW.step``)."""
        lookup = self._noise_std_lookup()
        if lookup is None:
            return super().step(closure)  # Φ = 0: torch's AdamW (Adam for a group with coupled decay), exactly
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            decoupled = group.get("decoupled_weight_decay", True)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("DPAdamBC does not support sparse gradients.")
                state = self.state[p]
                if len(state) == 0:  # the same state as torch.optim.AdamW's (checkpoints interchange)
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                phi = lookup(p) ** 2
                grad = p.grad
                if wd != 0:
                    if decoupled:
                        p.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(p, alpha=wd)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                denom = (v_hat - phi).clamp_(min=self.gamma).sqrt_()
                p.addcdiv_(m_hat, denom, value=-lr)
        return loss


def check_adam_bc_optim(optim: Any, optimizer: Any = None, scheduler: Any = None) -> None:
    """Refuse, before training, what DP-AdamBC cannot correct: an ``optim`` the Trainer does not build as
    ``torch.optim.AdamW``, a user optimizer other than ``torch.optim.AdamW`` / ``Adam`` / :class:`DPAdamBC`, or a
    user AdamW passed together with a scheduler (the scheduler is bound to the optimizer object being replaced)."""
    if optimizer is None:
        name = getattr(optim, "value", optim)
        if name not in ADAM_BC_OPTIMS:
            raise ValueError(
                f"dp_adam_bias_correction=True corrects Adam's second moment (Tang et al. 2024); optim={name!r} is "
                f"not one of the Trainer's torch AdamW choices {ADAM_BC_OPTIMS}. Use optim='adamw_torch' (or "
                "'adamw_torch_fused'), pass a torch.optim.AdamW with optimizers=(optimizer, None), or turn "
                "dp_adam_bias_correction off."
            )
        return
    inner = _innermost(optimizer)
    if isinstance(inner, DPAdamBC):
        return
    if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(
            f"dp_adam_bias_correction=True needs an Adam-family optimizer whose second moment it can correct "
            f"(torch.optim.AdamW, torch.optim.Adam or hf_dp.DPAdamBC); got {type(inner).__name__}. Turn "
            "dp_adam_bias_correction off for this optimizer."
        )
    if scheduler is not None:
        raise ValueError(
            "dp_adam_bias_correction=True replaces the torch.optim.AdamW you passed with hf_dp.DPAdamBC, but the "
            "learning-rate scheduler you passed with it is bound to your optimizer object. Pass "
            "optimizers=(optimizer, None) and choose the schedule with lr_scheduler_type, or build "
            "hf_dp.DPAdamBC(params, ...) yourself and pass it with your scheduler (the trainer sets its noise std)."
        )
    for group in inner.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"dp_adam_bias_correction=True: DPAdamBC (Tang et al. 2024, Alg. 1) has no "
                                 f"{flag}=True variant; build the optimizer with {flag}=False.")


def _innermost(optimizer: Any) -> Any:
    """The optimizer inside wrappers such as accelerate's ``AcceleratedOptimizer``."""
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__name__ == "AcceleratedOptimizer":
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def bias_corrected_adam(optimizer: torch.optim.Optimizer, noise_std: NoiseStd, gamma: float) -> torch.optim.Optimizer:
    """``optimizer`` with DP-AdamBC: a :class:`DPAdamBC` on the same parameter groups (their learning rates, betas and
    weight decays) and state, or, for a :class:`DPAdamBC` (also inside accelerate's
    wrapper), the same object with ``noise_std`` and ``gamma`` set. ``torch.optim.Adam`` keeps its coupled decay."""
    check_adam_bc_optim(None, optimizer)
    inner = _innermost(optimizer)
    if isinstance(inner, DPAdamBC):
        inner.noise_std, inner.gamma = noise_std, float(gamma)
        return optimizer
    if not isinstance(inner, torch.optim.AdamW):  # torch.optim.Adam: its coupled L2 decay must stay coupled
        for group in inner.param_groups:
            if group.get("weight_decay") and "decoupled_weight_decay" not in group:
                raise ValueError("dp_adam_bias_correction=True with torch.optim.Adam(weight_decay>0) needs torch >= "
                                 "2.6 (Adam's decoupled_weight_decay flag); use torch.optim.AdamW.")
            group.setdefault("decoupled_weight_decay", False)
    keep = {k: inner.defaults[k] for k in ("foreach", "fused") if inner.defaults.get(k) is not None}
    new = DPAdamBC(inner.param_groups, noise_std=noise_std, gamma=gamma, **keep)
    for p, state in inner.state.items():
        new.state[p] = state
    return new
