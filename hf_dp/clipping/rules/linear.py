"""The linear family: ``nn.Linear``, its subclasses with their own ``forward`` (verified on the first batch to
compute ``F.linear(x, W, b)``: Falcon's ``FalconLinear``) and transformers' ``Conv1D`` (GPT-2: ``x W + b``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .base import Rule, UnsupportedLayerError, Use, as_btd, close, run_with_params
from .registry import own_forward, register_builtin

__all__: list[str] = []


def _linear(module: nn.Linear, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y = x Wᵀ + b`` with ``W`` of shape (out, in): ``G_W = gᵀ a``, ``G_b = Σ_t g``."""
    a = as_btd(inp, module.in_features)
    g = as_btd(grad, module.out_features)
    uses = [Use(module.weight, g, a, module.out_features, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


def _conv1d(module: Conv1D, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """HF ``Conv1D`` (GPT-2): ``y = x W + b`` with ``W`` of shape (in, out): ``G_W = aᵀ g``, ``G_b = Σ_t g``."""
    d_in, d_out = module.weight.shape
    a = as_btd(inp, d_in)
    g = as_btd(grad, d_out)
    uses = [Use(module.weight, a, g, d_in, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


def _verify_linear_subclass(module: nn.Linear, name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """An ``nn.Linear`` subclass with its own ``forward`` (Falcon's ``FalconLinear``: ``x @ W.T + b``) is clipped
    with the linear rule only if, on real activations, its output is ``F.linear(x, W, b)`` — for its own weight and
    for a random one (the output is that affine function of the parameters, not merely equal at one point)."""
    tol = 1e-2 if out.dtype in (torch.float16, torch.bfloat16) else 1e-4
    with torch.no_grad():
        gen = torch.Generator(device=module.weight.device).manual_seed(0)
        w_r = torch.randn(module.weight.shape, generator=gen, device=module.weight.device, dtype=module.weight.dtype)
        b_r = None if module.bias is None else torch.randn(module.bias.shape, generator=gen,
                                                             device=module.bias.device, dtype=module.bias.dtype)
        ok = close(F.linear(inp, module.weight, module.bias), out, tol) and \
            close(run_with_params(module, inp, w_r, b_r), F.linear(inp, w_r, b_r), tol)
    if not ok:
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}) subclasses nn.Linear but its forward does not compute "
            "F.linear(x, weight, bias) (checked on this batch); hf_dp has no exact per-example rule for it. "
            "Freeze it (param.requires_grad_(False)) or train it through a PEFT adapter."
        )


_LINEAR = Rule("linear", _linear, ("weight", "bias"))
_LINEAR_SUBCLASS = Rule("linear_subclass", _linear, ("weight", "bias"), verify=_verify_linear_subclass)
_CONV1D = Rule("hf_conv1d", _conv1d, ("weight", "bias"))

_is_plain_linear = own_forward(nn.Linear)
register_builtin("hf_conv1d", lambda m: _CONV1D if isinstance(m, Conv1D) else None)
register_builtin("linear", lambda m: _LINEAR if _is_plain_linear(m) else None)
register_builtin("linear_subclass", lambda m: _LINEAR_SUBCLASS if isinstance(m, nn.Linear) else None)
