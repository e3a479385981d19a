"""One small rule per layer type: how a layer's per-example parameter gradients factor.

Rules report every parameter the layer has; the engine keeps the uses of the parameters being trained.

Every rule returns, for each trainable parameter the layer owns, a :class:`Use`: the per-example gradient of that
parameter in this call is ``G_i = L_iᵀ R_i`` (reshaped to the parameter's shape), with

* ``L_i`` of shape ``(T, d_L)`` — dense, or given implicitly as ``T`` row indices of a one-hot matrix (embeddings), or
  all ones with ``d_L = 1`` (biases and norm scales, ``G_i = Σ_t R_{i,t}``);
* ``R_i`` of shape ``(T, d_R)``.

This is the factorisation behind ghost clipping (Li et al. 2022, §4 and App. F): ``‖G_i‖² = ⟨L_i L_iᵀ, R_i R_iᵀ⟩``
can be computed from two ``T × T`` Gram matrices without ever forming ``G_i``. A parameter used several times in
one forward (tied embeddings: GPT-2 ``wte``/``lm_head``) has one per-example gradient, the sum of its uses'
``L_uᵀ R_u``; the engine (``engine.py``) handles the cross terms. Rules only say how a layer factors; the engine
decides how to compute norms and clipped sums from the factors.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

__all__ = ["Use", "find_rule", "UnsupportedLayerError", "rule_parameters"]


class UnsupportedLayerError(ValueError):
    """A layer with trainable parameters that no per-example rule covers (or covers only in an unsupported setting)."""


@dataclass
class Use:
    """One use of a parameter in one forward call: per-example gradient ``G_i = L_iᵀ R_i``.

    Attributes:
        param: the parameter.
        left: ``(B, T, d_L)`` dense, ``(B, T)`` long indices (one-hot rows), or ``None`` (ones, d_L=1).
        right: ``(B, T, d_R)``.
        left_dim: ``d_L``.
        module_name: qualified name of the module, for error messages.
    """

    param: nn.Parameter
    left: torch.Tensor | None
    right: torch.Tensor
    left_dim: int
    module_name: str

    @property
    def kind(self) -> str:
        """``"dense"``, ``"index"`` or ``"ones"``."""
        if self.left is None:
            return "ones"
        return "index" if self.left.dtype in (torch.int32, torch.int64) else "dense"

    @property
    def batch_size(self) -> int:
        return self.right.shape[0]

    @property
    def seq_len(self) -> int:
        return self.right.shape[1]


def _as_btd(x: torch.Tensor, d: int) -> torch.Tensor:
    """View ``(B, ..., d)`` as ``(B, T, d)``: every non-batch, non-feature axis is a 'token' axis."""
    if x.dim() == 1:
        return x.reshape(1, 1, d)
    return x.reshape(x.shape[0], -1, d)


def _linear(module: nn.Linear, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y = x Wᵀ + b`` with ``W`` of shape (out, in): ``G_W = gᵀ a``, ``G_b = Σ_t g``."""
    a = _as_btd(inp, module.in_features)
    g = _as_btd(grad, module.out_features)
    uses = [Use(module.weight, g, a, module.out_features, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


def _conv1d(module: Conv1D, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """HF ``Conv1D`` (GPT-2): ``y = x W + b`` with ``W`` of shape (in, out): ``G_W = aᵀ g``, ``G_b = Σ_t g``."""
    d_in, d_out = module.weight.shape
    a = _as_btd(inp, d_in)
    g = _as_btd(grad, d_out)
    uses = [Use(module.weight, a, g, d_in, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


def _embedding(module: nn.Embedding, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y_t = W[ids_t]``: ``G_W = onehot(ids)ᵀ g``; the ``padding_idx`` row gets no gradient."""
    ids = inp.reshape(inp.shape[0], -1) if inp.dim() > 1 else inp.reshape(1, -1)
    g = _as_btd(grad, module.embedding_dim)
    if module.padding_idx is not None:
        g = g.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0.0)
    return [Use(module.weight, ids, g, module.num_embeddings, name)]


def _check_embedding(module: nn.Embedding, name: str) -> None:
    if module.scale_grad_by_freq:
        raise UnsupportedLayerError(
            f"{name}: nn.Embedding(scale_grad_by_freq=True) scales gradients by token counts over the whole batch, "
            "which mixes examples; per-example clipping cannot bound that. Use scale_grad_by_freq=False."
        )
    if module.sparse:
        raise UnsupportedLayerError(f"{name}: sparse embedding gradients are not supported; use sparse=False.")
    if module.max_norm is not None:
        raise UnsupportedLayerError(f"{name}: nn.Embedding(max_norm=...) renormalises weights in forward; unsupported.")


def _layer_norm(module: nn.LayerNorm, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y = w ⊙ x̂ + b`` with ``x̂`` the normalised input: ``G_w = Σ_t g ⊙ x̂``, ``G_b = Σ_t g``."""
    d = module.weight.numel() if module.weight is not None else module.bias.numel()
    x_hat = F.layer_norm(inp, module.normalized_shape, None, None, module.eps)
    g = _as_btd(grad, d)
    uses = []
    if module.weight is not None:
        uses.append(Use(module.weight, None, g * _as_btd(x_hat, d).to(g.dtype), 1, name))
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


_RMS_OFFSET: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def _rms_run(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The layer's own forward on ``x`` with its weight replaced (no hooks run, the module is not modified)."""
    clone = copy.copy(module)  # shares everything but the parameter dict
    clone._parameters = dict(module._parameters)
    clone._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
    with torch.no_grad():
        return clone.forward(x)


def _rms_unit_output(module: nn.Module, x: torch.Tensor, offset: float) -> torch.Tensor:
    """``x̂``: the layer's own output with its scale set to one (``weight = 1 - offset``).

    Running the module itself (instead of re-implementing its normalisation) reproduces its exact arithmetic,
    including the float32 upcast Llama-style norms do internally.
    """
    return _rms_run(module, x, torch.full_like(module.weight, 1.0 - offset))


def _rms_norm(module: nn.Module, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """RMSNorm (``torch.nn.RMSNorm``, Llama/Mistral/Qwen/T5 style): ``y = w ⊙ x̂`` (or ``(1 + w) ⊙ x̂``, Gemma),
    ``x̂ = x / rms(x)``: ``G_w = Σ_t g ⊙ x̂`` either way."""
    d = module.weight.numel()
    x_hat = _rms_unit_output(module, inp, _RMS_OFFSET.get(module, 0.0))
    g = _as_btd(grad, d)
    return [Use(module.weight, None, g * _as_btd(x_hat, d).to(g.dtype), 1, name)]


def _verify_rms_norm(module: nn.Module, name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """Check once, on real activations, that this RMSNorm-like layer computes ``w ⊙ x̂`` or ``(1 + w) ⊙ x̂``, where
    ``x̂`` (its output at unit scale) does not depend on ``w`` — the form whose weight gradient is ``Σ_t g ⊙ x̂``.

    The rule is chosen by class name for third-party RMSNorm classes; a layer that computes something else must
    fail loudly rather than be clipped with a wrong gradient. Records which of the two forms the layer uses.
    """
    with torch.no_grad():
        w = module.weight
        tol = 1e-2 if out.dtype in (torch.float16, torch.bfloat16) else 1e-4
        gen = torch.Generator(device=w.device).manual_seed(0)
        scale = torch.rand(w.shape, generator=gen, device=w.device, dtype=w.dtype) + 0.5
        for offset in (0.0, 1.0):
            x_hat = _rms_unit_output(module, inp, offset)
            candidate = (w + offset) * x_hat
            scaled = _rms_run(module, inp, scale - offset)  # must equal scale ⊙ x̂ for any scale, not just this w
            if candidate.shape == out.shape and torch.allclose(candidate.to(out.dtype), out, rtol=tol, atol=tol) \
                    and torch.allclose(scaled, scale * x_hat, rtol=tol, atol=tol):
                _RMS_OFFSET[module] = offset
                return
    raise UnsupportedLayerError(
        f"{name} ({type(module).__name__}) looks like an RMSNorm but does not compute weight * x / rms(x); "
        "hf_dp has no exact per-example rule for it. Freeze it (param.requires_grad_(False))."
    )


RuleFn = Callable[[nn.Module, str, torch.Tensor, torch.Tensor, torch.Tensor], list[Use]]


@dataclass(frozen=True)
class Rule:
    """A layer type's rule: its per-example factorisation and the parameters it covers."""

    name: str
    uses: RuleFn
    params: tuple[str, ...]
    check: Callable[[nn.Module, str], None] | None = None
    verify: Callable[[nn.Module, str, torch.Tensor, torch.Tensor], None] | None = None


_LINEAR = Rule("linear", _linear, ("weight", "bias"))
_CONV1D = Rule("hf_conv1d", _conv1d, ("weight", "bias"))
_EMBEDDING = Rule("embedding", _embedding, ("weight",), check=_check_embedding)
_LAYER_NORM = Rule("layer_norm", _layer_norm, ("weight", "bias"))
_RMS_NORM = Rule("rms_norm", _rms_norm, ("weight",), verify=_verify_rms_norm)


def _is_rms_norm(module: nn.Module) -> bool:
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return True
    cls = type(module).__name__
    looks_rms = cls.endswith("RMSNorm") or cls == "T5LayerNorm"
    params = dict(module.named_parameters(recurse=False))
    return looks_rms and set(params) == {"weight"} and params["weight"].dim() == 1


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s own (non-recursive) parameters, or ``None`` if no rule covers this layer type.

    Exact type checks come first; subclasses of ``nn.Linear`` / ``nn.Embedding`` are accepted only when they do not
    override ``forward`` (a subclass with its own forward may compute something else).
    """
    if isinstance(module, Conv1D):
        return _CONV1D
    for base, rule in ((nn.Linear, _LINEAR), (nn.Embedding, _EMBEDDING), (nn.LayerNorm, _LAYER_NORM)):
        if isinstance(module, base) and type(module).forward is base.forward:
            return rule
    if _is_rms_norm(module):
        return _RMS_NORM
    return None


def rule_parameters(rule: Rule, module: nn.Module) -> list[str]:
    """Names of ``module``'s own trainable parameters that ``rule`` covers."""
    return [n for n in rule.params if getattr(module, n, None) is not None and getattr(module, n).requires_grad]
