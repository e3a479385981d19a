"""What a layer rule is made of: :class:`Use` (one use of a parameter, its per-example gradient as two factors),
:class:`Rule` (a layer type's factorisation and checks), :class:`UnsupportedLayerError`, and the small helpers the
rule families share (:func:`as_btd`, :func:`close`, :func:`run_with_params`).

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

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Attach", "Rule", "RuleFn", "UnsupportedLayerError", "Use", "as_btd", "call_inputs", "close",
           "run_with_params"]


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
        token_rows: the batch axis holds the micro-batch's tokens flattened example-major (``B·T`` rows, token ``t``
            of example ``t // T``: MoE layers see ``hidden_states.view(-1, d)``); see :meth:`by_example`.
    """

    param: nn.Parameter
    left: torch.Tensor | None
    right: torch.Tensor
    left_dim: int
    module_name: str
    token_rows: bool = False

    def by_example(self, batch_size: int) -> Use:
        """A ``token_rows`` use regrouped per example: ``(B·T, T', d) → (B, T·T', d)``, the same ``Σ Lᵀ R``."""
        if not self.token_rows:
            return self
        if self.right.shape[0] % batch_size:
            raise UnsupportedLayerError(
                f"{self.module_name}: {self.right.shape[0]} token rows cannot be split into {batch_size} examples.")

        def regroup(x):
            return None if x is None else x.reshape(batch_size, -1, *x.shape[2:])

        return Use(self.param, regroup(self.left), regroup(self.right), self.left_dim, self.module_name)

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


def as_btd(x: torch.Tensor, d: int) -> torch.Tensor:
    """View ``(B, ..., d)`` as ``(B, T, d)``: every non-batch, non-feature axis is a 'token' axis."""
    if x.dim() == 1:
        return x.reshape(1, 1, d)
    if x.numel() == 0 and x.shape[-1] == d:  # an empty parameter's factors (d = 0): -1 would be ambiguous
        return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), d)
    return x.reshape(x.shape[0], -1, d)


def call_inputs(inp) -> tuple:
    """A hooked call's inputs as a tuple: the first input alone, or every input (``Rule.all_inputs``: gated norms)."""
    return inp if isinstance(inp, tuple) else (inp,)


def run_with_params(module: nn.Module, inp, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's own forward on the call's own inputs (``inp``: the first input, or all of them as a tuple, e.g.
    a gated norm's ``(x, gate)``) with its weight / bias replaced (no hooks run, the module is not modified)."""
    clone = copy.copy(module)  # shares everything but the parameter dict
    clone._parameters = dict(module._parameters)
    for key, value in (("weight", weight), ("bias", bias)):
        if module._parameters.get(key) is not None:
            clone._parameters[key] = nn.Parameter(value, requires_grad=False)
    with torch.no_grad():
        return clone.forward(*call_inputs(inp))


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Same shape and equal to ``tol`` (relative, and absolute relative to ``b``'s largest entry)."""
    if a.shape != b.shape:
        return False
    scale = float(b.abs().max().clamp(min=1.0)) if b.numel() else 1.0
    return bool(torch.allclose(a.to(b.dtype), b, rtol=tol, atol=tol * scale))


Attach = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
RuleFn = Callable[[nn.Module, str, torch.Tensor, torch.Tensor, torch.Tensor], list[Use]]


@dataclass(frozen=True)
class Rule:
    """A layer type's rule: its per-example factorisation and the parameters it covers.

    ``capture`` (optional): instead of the module's own input and output, the rule factors functional calls made
    inside its forward. ``capture(module, name, batch_size, attach)`` returns a context manager, entered for the
    duration of the module's forward, that hands each such call's input and output to ``attach(inp, out) -> out``
    (which hooks the output's gradient and returns the tensor the forward must continue with); ``uses`` then gets
    that call's input and output gradient.
    """

    name: str
    uses: RuleFn
    params: tuple[str, ...]
    check: Callable[[nn.Module, str], None] | None = None
    verify: Callable[[nn.Module, str, torch.Tensor, torch.Tensor], None] | None = None
    capture: Callable[[nn.Module, str, int | None, Attach], contextlib.AbstractContextManager] | None = None
    all_inputs: bool = False  # ``uses`` / ``verify`` get every positional and keyword input as a tuple
