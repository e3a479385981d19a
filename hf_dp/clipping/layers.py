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

import contextlib
import copy
import inspect
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
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


def _as_btd(x: torch.Tensor, d: int) -> torch.Tensor:
    """View ``(B, ..., d)`` as ``(B, T, d)``: every non-batch, non-feature axis is a 'token' axis."""
    if x.dim() == 1:
        return x.reshape(1, 1, d)
    if x.numel() == 0 and x.shape[-1] == d:  # an empty parameter's factors (d = 0): -1 would be ambiguous
        return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), d)
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


_AFFINE_FORM: weakref.WeakKeyDictionary[nn.Module, tuple[float, int, bool]] = weakref.WeakKeyDictionary()


def _call_inputs(inp) -> tuple:
    """A hooked call's inputs as a tuple: the first input alone, or every input (``Rule.all_inputs``: gated norms)."""
    return inp if isinstance(inp, tuple) else (inp,)


def _first_rows(inputs: tuple, rows: int) -> tuple:
    """The call's inputs restricted to the first ``rows`` rows of the first input (inputs with its first axis)."""
    n = inputs[0].shape[0]
    return tuple(a[:rows] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n else a for a in inputs)


def _affine_run(module: nn.Module, inp, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's own forward on the call's own inputs (``inp``: the first input, or all of them as a tuple, e.g.
    a gated norm's ``(x, gate)``) with its weight / bias replaced (no hooks run, the module is not modified)."""
    clone = copy.copy(module)  # shares everything but the parameter dict
    clone._parameters = dict(module._parameters)
    for key, value in (("weight", weight), ("bias", bias)):
        if module._parameters.get(key) is not None:
            clone._parameters[key] = nn.Parameter(value, requires_grad=False)
    with torch.no_grad():
        return clone.forward(*_call_inputs(inp))


def _unit_output(module: nn.Module, x, offset: float, additive: bool = False) -> torch.Tensor:
    """``x̂``: the output's derivative in the weight, ``y(w = 1, b = 0) - y(w = 0, b = 0)`` — one run at
    ``weight = 1 - offset`` when ``y(0, 0) = offset · x̂`` (the usual norms), two runs when the layer adds a
    parameter-free term (``additive``: ConvNeXt V2's ``GRN`` adds its input).

    Running the module itself (instead of re-implementing its normalisation) reproduces its exact arithmetic,
    including the float32 upcast Llama-style norms do internally.
    """
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    zero_b = None if b is None else torch.zeros_like(b)
    if additive:
        return _affine_run(module, x, torch.ones_like(w), zero_b) - _affine_run(module, x, torch.zeros_like(w), zero_b)
    return _affine_run(module, x, None if w is None else torch.full_like(w, 1.0 - offset), zero_b)


def _param_axis(p: torch.Tensor) -> int | None:
    """For a parameter with a single non-singleton axis (``(d,)``, ConvNeXt V2's ``(1, 1, 1, d)``): that axis counted
    from the output's end when the parameter broadcasts against it; ``None`` for a multi-axis parameter."""
    big = [k for k, n in enumerate(p.shape) if n != 1]
    return big[0] - p.dim() if len(big) == 1 else None


def _affine_norm(module: nn.Module, name: str, inp, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """Elementwise-affine layers ``y = w ⊙ x̂ + b + y(0, 0)`` (RMSNorm, T5/Gemma/Cohere/OLMo norms, Nemotron's
    ``LayerNorm1P``, SqueezeBERT's channel-first LayerNorm, layer-scale, gated RMSNorms ``x̂(x, gate)``, ConvNeXt V2's
    ``GRN``), with ``x̂`` the output's derivative in ``w`` computed by the layer itself: ``G_w = Σ_t g ⊙ x̂``,
    ``G_b = Σ_t g``. The form and the axis the parameters run along were verified on real activations
    (:func:`_verify_affine_norm`). Gated norms (``all_inputs``) may see tokens flattened example-major
    (``(B·T·H, d)``: Qwen3-Next / Qwen3.5), so their 2-D inputs' uses are ``token_rows`` (regrouped per example).
    """
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    offset, axis, additive = _AFFINE_FORM.get(module, (0.0, -1, False))
    d = (w if w is not None else b).numel()
    # Rows flattened example-major ((B·T·H, d), as reshape(-1, d) of a batch-first tensor gives; the first-step probe
    # proves layouts for single-input layers only): regrouped per example. Other inputs keep their batch axis first.
    rows = isinstance(inp, tuple) and inp[0].dim() == 2
    g = _as_btd(grad.movedim(axis, -1), d)
    uses = []
    if w is not None:
        x_hat = _unit_output(module, inp, offset, additive).movedim(axis, -1)
        uses.append(Use(w, None, g * _as_btd(x_hat, d).to(g.dtype), 1, name, token_rows=rows))
    if b is not None:
        uses.append(Use(b, None, g, 1, name, token_rows=rows))
    return uses


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    if a.shape != b.shape:
        return False
    scale = float(b.abs().max().clamp(min=1.0)) if b.numel() else 1.0
    return bool(torch.allclose(a.to(b.dtype), b, rtol=tol, atol=tol * scale))


def _verify_affine_form(module: nn.Module, name: str, inp, out: torch.Tensor) -> None:
    """Check once, on real activations, that this layer is affine in its parameters: ``y(w, b) = w ⊙ x̂ + b +
    y(0, 0)``, where ``x̂ = y(1, 0) - y(0, 0)`` and ``y(0, 0)`` depend neither on ``w`` / ``b`` nor on the other
    examples of the batch — the form whose per-example gradients are ``Σ_t g ⊙ x̂`` and ``Σ_t g``. The layer is re-run
    on the call's own inputs (a gated norm's gate included).

    The rule is chosen by the layer's parameters (a ``weight`` and/or ``bias`` of one shape); a layer that computes
    something else must fail loudly rather than be clipped with a wrong gradient. Records whether ``y(0, 0)`` is a
    multiple ``o · x̂`` (0 for Llama/T5 norms, 1 for Gemma's ``(1 + w)`` and Nemotron's ``LayerNorm1P``: ``x̂`` is then
    one run of the layer) or a parameter-free term of its own (ConvNeXt V2's ``GRN`` adds its input), and the output
    axis the parameters run along (the last one, or a channel axis: SqueezeBERT normalises ``(B, C, T)``).
    """
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    p = w if w is not None else b
    tol = 1e-2 if out.dtype in (torch.float16, torch.bfloat16) else 1e-4
    _AFFINE_FORM.pop(module, None)
    inputs = _call_inputs(inp)
    with torch.no_grad():
        zero_b = None if b is None else torch.zeros_like(b)
        zero_w = None if w is None else torch.zeros_like(w)
        y0 = _affine_run(module, inp, zero_w, zero_b)
        x_hat, offset, additive = None, 0.0, False
        if w is not None:
            x_hat = _affine_run(module, inp, torch.ones_like(w), zero_b) - y0
            offset = round(float((y0 * x_hat).sum() / (x_hat * x_hat).sum().clamp(min=1e-30)), 6)
            additive = not _close(y0, offset * x_hat, tol)
            offset = 0.0 if additive else offset
        gen = torch.Generator(device=p.device).manual_seed(0)
        w_r = None if w is None else torch.rand(w.shape, generator=gen, device=p.device, dtype=p.dtype) + 0.5
        b_r = None if b is None else torch.randn(b.shape, generator=gen, device=p.device, dtype=p.dtype)
        y_r = _affine_run(module, inp, w_r, b_r)
        alone = inputs[0].shape[0] < 2
        if not alone:
            first = _first_rows(inputs, 1)
            first = first if isinstance(inp, tuple) else first[0]
            alone = _close(_affine_run(module, first, zero_w, zero_b), y0[:1], tol) and (
                w is None or _close(_unit_output(module, first, offset, additive), x_hat[:1], tol))
        ref = y0 if x_hat is None else x_hat
        p_axis = _param_axis(p)
        if p_axis is None:
            axes = [-1] if tuple(ref.shape[ref.dim() - p.dim():]) == tuple(p.shape) else []
        elif p.dim() > 1:
            axes = [p_axis] if ref.dim() >= p.dim() and ref.shape[p_axis] == p.numel() else []
        else:
            axes = [a - ref.dim() for a in range(ref.dim() - 1, 0, -1) if ref.shape[a] == p.numel()]
        for axis in axes:
            def form(wt, bt, axis=axis):
                flat = (lambda t: t) if p_axis is None else (lambda t: t.reshape(-1))  # noqa: E731
                y = y0.movedim(axis, -1)
                if wt is not None:
                    y = y + flat(wt) * x_hat.movedim(axis, -1)
                return (y if bt is None else y + flat(bt)).movedim(-1, axis)

            if alone and _close(form(w, b), out, tol) and _close(y_r, form(w_r, b_r), tol):
                _AFFINE_FORM[module] = (offset, axis, additive)
                return
    raise UnsupportedLayerError(
        f"{name} ({type(module).__name__}) has a weight/bias like a normalisation layer but does not compute "
        "weight * x_hat + bias + y0 (not affine in them, or x_hat / y0 depend on its parameters or on the other "
        "examples; checked on this batch); hf_dp has no exact per-example rule for it. Freeze it "
        "(param.requires_grad_(False)) or train it through a PEFT adapter."
    )


def _verify_affine_norm(module: nn.Module, name: str, inp, out: torch.Tensor) -> None:
    """:func:`_verify_affine_form`; a re-run that fails (inputs passed by keyword in another order than the
    forward's signature, a forward needing more than its call's inputs) is a refusal with that cause, not a crash."""
    try:
        _verify_affine_form(module, name, inp, out)
    except UnsupportedLayerError:
        raise
    except Exception as err:  # noqa: BLE001 - reported as the cause of the refusal
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}) has a weight/bias like a normalisation layer, but re-running it on "
            f"this call's inputs with other parameter values failed ({type(err).__name__}: {err}), so hf_dp cannot "
            "check that it computes weight * x_hat + bias + y0 and has no exact per-example rule for it. Freeze it "
            "(param.requires_grad_(False)) or train it through a PEFT adapter.") from err


# ----------------------------------------------------------------------------------------------------- convolutions
def _conv(module: nn.Conv1d | nn.Conv2d, name: str, inp: torch.Tensor, out: torch.Tensor,
          grad: torch.Tensor) -> list[Use]:
    """``nn.Conv1d`` / ``nn.Conv2d`` via unfold (as Opacus ``grad_sample/conv.py``): with ``P`` the unfolded input
    patches ``(B, L, C_in/groups · k)`` and ``g`` the output gradient ``(B, L, C_out)`` over the ``L`` output
    positions, ``G_W = gᵀ P`` (groups = 1); ``G_b = Σ_l g``.

    Grouped / depthwise convolutions (Mamba): each output channel sees only its group's patches, so the per-position
    factor is the block outer product ``R_l = [g_{l,j} ⊗ P_{l,j}]_j`` of size ``|W|`` and ``G_W = Σ_l R_l`` (a "ones"
    use) — ``kernel · C_in/groups`` times the activation's memory, small for depthwise kernels.
    """
    nd = module.weight.dim() - 2
    c_out, c_in_g = module.weight.shape[:2]
    k = module.weight.shape[2:]
    x = inp if inp.dim() == nd + 2 else inp.unsqueeze(0)  # unbatched input: a batch of one
    if module.padding_mode != "zeros":
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = (0,) * nd
    elif module.padding == "same":
        total = [d * (kk - 1) for d, kk in zip(module.dilation, k)]
        x = F.pad(x, [p for t in reversed(total) for p in (t // 2, t - t // 2)])
        padding = (0,) * nd
    elif module.padding == "valid":
        padding = (0,) * nd
    else:
        padding = module.padding
    if nd == 1:  # a 1-D convolution is a 2-D one over a height-1 image
        x = x.unsqueeze(2)
        kernel, dilation, stride, padding = (1, k[0]), (1, module.dilation[0]), (1, module.stride[0]), (0, padding[0])
    else:
        kernel, dilation, stride = k, module.dilation, module.stride
    patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, C_in·k, L)
    b = patches.shape[0]
    g = grad.reshape(b, c_out, -1).transpose(1, 2)  # (B, L, C_out)
    patches = patches.transpose(1, 2)  # (B, L, C_in·k), channel-major like the weight
    groups = module.groups
    if groups == 1:
        uses = [Use(module.weight, g, patches, c_out, name)]
    else:
        seq = g.shape[1]
        g_blocks = g.reshape(b, seq, groups, c_out // groups, 1)
        p_blocks = patches.reshape(b, seq, groups, 1, c_in_g * patches.shape[-1] // (groups * c_in_g))
        outer = (g_blocks * p_blocks.to(g.dtype)).reshape(b, seq, -1)  # (B, L, |W|)
        uses = [Use(module.weight, None, outer, 1, name)]
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


# ------------------------------------------------------------------------------- subclasses with their own forward
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
        ok = _close(F.linear(inp, module.weight, module.bias), out, tol) and \
            _close(_affine_run(module, inp, w_r, b_r), F.linear(inp, w_r, b_r), tol)
    if not ok:
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}) subclasses nn.Linear but its forward does not compute "
            "F.linear(x, weight, bias) (checked on this batch); hf_dp has no exact per-example rule for it. "
            "Freeze it (param.requires_grad_(False)) or train it through a PEFT adapter."
        )


Attach = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _WeightCalls(TorchFunctionMode):
    """Active during a module's forward (``Rule.capture``): each ``functional(x, self.weight, ...)`` call is handed
    to ``attach(x, output) -> output`` (the engine's hook on that call's output), so the parent layer's rule applies
    to the call itself — exact whatever the module does around it. A dtype cast of the weight on its way to that
    call (DeepSeek-V3: ``weight.type(torch.float32)``) is the same weight (the cast's gradient is the identity). Any
    other use of the weight inside the forward (besides reading metadata) is refused.
    """

    functional = staticmethod(F.linear)
    _CASTS = frozenset({"type", "to", "float", "double", "half", "bfloat16"})

    def __init__(self, module: nn.Module, name: str, batch_size: int | None, attach: Attach):
        super().__init__()
        self.module, self.name, self.batch_size, self.attach = module, name, batch_size, attach
        self.aliases = [module.weight]  # the weight and its dtype casts (kept alive: identity checks)

    def call(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.attach(args[0], func(*args, **kwargs))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(a is w for a in (*args, *kwargs.values()) for w in self.aliases):
            return func(*args, **kwargs)
        result = None
        if getattr(func, "__name__", "") in self._CASTS and args and any(args[0] is w for w in self.aliases):
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result.shape == self.module.weight.shape:
                self.aliases.append(result)
                return result
        if func is self.functional and len(args) >= 2 and any(args[1] is w for w in self.aliases):
            return self.call(func, args, kwargs)
        result = func(*args, **kwargs) if result is None else result
        if getattr(func, "__name__", "") == "__get__" and not isinstance(result, torch.Tensor):
            return result  # metadata: weight.device, weight.dtype, weight.shape
        raise UnsupportedLayerError(
            f"{self.name} ({type(self.module).__name__}) uses its weight in its forward other than through "
            f"F.{self.functional.__name__} "
            f"({getattr(func, '__name__', func)}), so hf_dp cannot clip that use per example. Freeze the weight "
            "(param.requires_grad_(False)); if it is tied to another layer (e.g. an LM head), that freezes the other "
            "layer too — or train through a PEFT adapter."
        )


class _EmbeddingCalls(_WeightCalls):
    """An ``nn.Embedding`` subclass with its own ``forward``: its ``F.embedding(ids, self.weight, ...)`` calls get the
    plain embedding rule — a scale (Gemma / BART / XGLM ``*ScaledWordEmbedding``), an offset or computed position
    ids (OPT / BART / BioGPT learned positions) around them do not matter. A row lookup written as indexing
    (``self.weight[position_ids]``, ``self.weight[a:b]``: Whisper's decoder positions) is the same lookup and gets
    the same rule. Ids without the batch axis (``(1, T)`` or ``(T,)``: positions computed once and broadcast) are
    expanded to the micro-batch's ``B`` rows first, so each example gets its own rows (an output that broadcasts the
    same way downstream)."""

    functional = staticmethod(F.embedding)

    def call(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        ids, b = args[0], self.batch_size
        if b is not None:
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids  # (T,): positions with no batch axis (also for B = 1)
            ids = ids.expand(b, *ids.shape[1:]) if ids.shape[0] == 1 and b > 1 else ids
        return self.attach(ids, func(ids, *args[1:], **kwargs))

    def _lookup_ids(self, weight: torch.Tensor, index) -> torch.Tensor | None:
        """The ids of an indexing read of the weight that is a row lookup: ``weight[ids]`` with integer ids, or
        ``weight[a:b]`` (Whisper's decoder positions: rows ``a..b-1``); ``None`` for anything else. Not with a
        ``padding_idx``: indexing gives that row a gradient, which F.embedding (the rule's math) does not."""
        if self.module.padding_idx is not None:
            return None
        if isinstance(index, torch.Tensor) and index.dtype in (torch.int64, torch.int32) and index.dim() <= 2:
            return index.long()
        if isinstance(index, slice) and index.step in (None, 1) and all(
                v is None or isinstance(v, int) for v in (index.start, index.stop)):
            return torch.arange(*index.indices(weight.shape[0])[:2], device=weight.device)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and any(args[0] is w for w in self.aliases):
            ids = self._lookup_ids(args[0], args[1])
            if ids is not None:  # an embedding lookup written as indexing: the embedding rule applies to it
                return self.call(F.embedding, (ids, args[0]), {})
        return super().__torch_function__(func, types, args, kwargs)


class _RouterCalls(_WeightCalls):
    """A MoE router (a module with a 2-D ``weight`` scoring tokens for experts): its ``F.linear(x, self.weight, b)``
    call gets the linear rule. Routers see the tokens flattened example-major (``(B·T, d)``); the call is made on
    the ``(B, T, d)`` view so each row stays with its example. A ``bias`` parameter must be that call's bias (the
    rule's ``G_b = Σ_t g``): any other use of it, or the weight applied without it, is refused."""

    def __init__(self, module: nn.Module, name: str, batch_size: int | None, attach: Attach):
        super().__init__(module, name, batch_size, attach)
        bias = getattr(module, "bias", None)
        self.biases = [bias] if isinstance(bias, nn.Parameter) else []  # the bias and its dtype casts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.biases:
            fname = getattr(func, "__name__", "")
            linear = func is self.functional and len(args) >= 2 and any(args[1] is w for w in self.aliases)
            bias_arg = (args[2] if len(args) > 2 else kwargs.get("bias")) if linear else None
            with_bias = any(bias_arg is b for b in self.biases)
            if linear and not with_bias:
                self._refuse_bias("applies its weight without its bias")
            if not linear and any(a is b for a in (*args, *kwargs.values()) for b in self.biases):
                result = func(*args, **kwargs)
                if fname in self._CASTS and args and any(args[0] is b for b in self.biases) and \
                        isinstance(result, torch.Tensor) and result.shape == self.biases[0].shape:
                    self.biases.append(result)
                    return result
                if fname == "__get__" and not isinstance(result, torch.Tensor):
                    return result  # metadata
                self._refuse_bias(f"uses its bias other than as F.linear's bias ({fname or func})")
        return super().__torch_function__(func, types, args, kwargs)

    def _refuse_bias(self, what: str) -> None:
        raise UnsupportedLayerError(
            f"{self.name} ({type(self.module).__name__}) {what}, so hf_dp's router rule (bias gradient = the sum of "
            "the F.linear output's gradient) does not hold for it. Freeze its bias (requires_grad_(False)) or train "
            "the model through a PEFT adapter (LoRA).")

    def call(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        x, b = args[0], self.batch_size
        if not (b and x.dim() == 2 and x.shape[0] % b == 0):
            return self.attach(x, func(*args, **kwargs))
        x3 = x.view(b, x.shape[0] // b, x.shape[1])
        return self.attach(x3, func(x3, *args[1:], **kwargs)).reshape(x.shape[0], -1)


# ------------------------------------------------------------------------------------------- mixture of experts
def _is_experts(module: nn.Module) -> bool:
    """transformers 5 expert blocks (``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS,
    DeepSeek-V3, …): 3-D ``[gate_]up_proj`` / ``down_proj`` parameters, one slice per expert."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, nn.Parameter) and down.dim() == 3 and hasattr(module, "has_gate") \
        and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


def _expert_params(module: nn.Module, overrides: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    up = "gate_up_proj" if module.has_gate else "up_proj"
    names = {"up": up, "down": "down_proj", "up_b": f"{up}_bias", "down_b": "down_proj_bias"}
    out = {}
    for key, attr in names.items():
        p = (overrides or {}).get(attr, getattr(module, attr, None) if (key in ("up", "down") or module.has_bias)
                                   else None)
        out[key] = p
    return out


def _expert_up(module: nn.Module, p: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s up-projection of token rows ``x``."""
    w = p["up"][e]
    u = x @ w if module.is_transposed else x @ w.t()
    return u if p["up_b"] is None else u + p["up_b"][e]


def _expert_act(module: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """The module's own gate (``_apply_gate``: SwiGLU, GPT-OSS's clamped GLU, …) or activation."""
    return module._apply_gate(u) if module.has_gate else module.act_fn(u)


def _expert_down(module: nn.Module, p: dict, e: int, h: torch.Tensor) -> torch.Tensor:
    w = p["down"][e]
    y = h @ w if module.is_transposed else h @ w.t()
    return y if p["down_b"] is None else y + p["down_b"][e]


def _experts_recompute(module: nn.Module, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                       p: dict) -> torch.Tensor:
    """The experts' output from their parameters, as :func:`_experts` factors it (checked against the module)."""
    out = torch.zeros_like(x)
    for e in range(module.num_experts):
        tok, slot = torch.where(idx == e)
        if tok.numel():
            y = _expert_down(module, p, e, _expert_act(module, _expert_up(module, p, e, x[tok])))
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
    return out


def _experts(module: nn.Module, name: str, inp: tuple, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """Routed experts ``y_t = Σ_k w_{t,k} down_e(act(up_e(x_t)))``, ``e = idx_{t,k}`` (transformers 5 expert blocks,
    3-D parameters). Per token, the gradient of expert ``e``'s slice is an outer product, so each example's gradient
    is a sum over its routed tokens; expert slices are disjoint blocks of one parameter. With ``δ_{t,e}`` the
    gradient at the up-projection's output (autograd through the module's own gate), ``h_{t,e}`` the activation and
    ``γ_{t,e} = w_{t,e} g_t`` the gradient at the down-projection's output:

    * ``up`` ``(E, 2I, D)``: one row per token, ``L_t = [δ_{t,e}]_e`` (zero for unrouted experts), ``R_t = x_t`` —
      the factors of a ``Linear(D, E·2I)``;
    * ``down`` ``(E, D, I)``: one row per (token, slot), ``L = γ_{t,e}`` in expert ``e``'s block, ``R = h_{t,e}``;
    * transposed storage (GPT-OSS: ``(E, D, 2I)``, ``(E, I, D)``) swaps which needs a row per slot;
    * biases: "ones" uses, ``R_t = [δ_{t,e}]_e`` and ``[γ_{t,e}]_e``.

    Rows are tokens (``token_rows``): the engine regroups them example-major. Loops run over experts only.
    """
    x, idx, weights = inp[0], inp[1], inp[2]
    p = _expert_params(module)
    n, d = x.shape
    n_exp, k = module.num_experts, idx.shape[-1]
    g = grad.reshape(n, d)
    dt = g.dtype
    x = x.to(dt)
    up, down = p["up"], p["down"]
    per_expert = []  # (e, tokens, slots, δ, h, γ)
    for e in range(n_exp):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        with torch.no_grad():
            u = _expert_up(module, p, e, x[tok].to(up.dtype))
        gamma = g[tok] * weights[tok, slot, None].to(dt)
        w_down = down[e].detach()
        g_h = gamma @ (w_down.t() if module.is_transposed else w_down).to(dt)
        with torch.enable_grad():
            u = u.detach().requires_grad_(True)
            h = _expert_act(module, u)
            (d_u,) = torch.autograd.grad(h, u, g_h.to(h.dtype))
        per_expert.append((e, tok, slot, d_u.to(dt), h.detach().to(dt), gamma))
    if not per_expert:
        return []

    def per_token(values: int) -> torch.Tensor:
        """``(n, E·width)``: each token's per-expert ``values`` (index into the tuples above), zero if unrouted."""
        width = per_expert[0][values].shape[-1]
        out = g.new_zeros(n, n_exp, width)
        for e, tok, slot, *vals in per_expert:
            out[tok, e] = vals[values - 3] * (weights[tok, slot, None].to(dt) if values == 4 else 1.0)
        return out.reshape(n, 1, n_exp * width)

    def per_slot(block: int, other: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, k, E·width)`` and ``(n, k, ·)``: one row per (token, slot), ``block`` in expert ``e``'s block."""
        left = g.new_zeros(n, k, n_exp * width)
        right = g.new_zeros(n, k, per_expert[0][other].shape[-1])
        for e, tok, slot, *vals in per_expert:
            left[tok, slot, e * width:(e + 1) * width] = vals[block - 3] if block < 6 else x[tok]
            right[tok, slot] = vals[other - 3]
        return left, right

    DELTA, H, GAMMA, X = 3, 4, 5, 6  # noqa: N806 (indices into per_expert's tuples; X: the token's input)
    if not module.is_transposed:
        uses = [Use(up, per_token(DELTA), x.reshape(n, 1, d), up.shape[0] * up.shape[1], name, token_rows=True),
                Use(down, *per_slot(GAMMA, H, d), down.shape[0] * down.shape[1], name, token_rows=True)]
    else:
        uses = [Use(up, *per_slot(X, DELTA, d), up.shape[0] * up.shape[1], name, token_rows=True),
                Use(down, per_token(H), g.reshape(n, 1, d), down.shape[0] * down.shape[1], name, token_rows=True)]
    if p["up_b"] is not None:
        uses.append(Use(p["up_b"], None, per_token(DELTA), 1, name, token_rows=True))
    if p["down_b"] is not None:
        uses.append(Use(p["down_b"], None, per_token(GAMMA), 1, name, token_rows=True))
    return uses


def _verify_experts(module: nn.Module, name: str, inp: tuple, out: torch.Tensor) -> None:
    """Check once, on real activations, that the expert block computes what :func:`_experts` factors — for its own
    parameters and for random ones (no post-expert norm, no other use of the parameters)."""
    x, idx, weights = inp[0], inp[1], inp[2]
    tol = 1e-2 if out.dtype in (torch.float16, torch.bfloat16) else 1e-4
    ok = not getattr(module, "has_post_expert_norm", False) and x.dim() == 2 and idx.dim() == 2
    if ok:
        with torch.no_grad():
            ok = _close(_experts_recompute(module, x, idx, weights, _expert_params(module)), out, tol)
            if ok:
                gen = torch.Generator(device=x.device).manual_seed(0)
                rand = {n: torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 0.1
                        for n, p in module.named_parameters(recurse=False)}
                clone = copy.copy(module)
                clone._parameters = {n: nn.Parameter(v, requires_grad=False) for n, v in rand.items()}
                ok = _close(_experts_recompute(module, x, idx, weights, _expert_params(module, rand)),
                            clone.forward(x, idx, weights), tol)
    if not ok:
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}): this expert block does not compute the routed gated MLP hf_dp's "
            "expert rule factors (checked on this batch); freeze its experts or train the model through LoRA on "
            "the attention layers."
        )


def _router(module: nn.Module, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """A router's ``F.linear(x, W, b)``: ``G_W = gᵀ x``, ``G_b = Σ_t g`` (as :func:`_linear`)."""
    d_out, d_in = module.weight.shape
    uses = [Use(module.weight, _as_btd(grad, d_out), _as_btd(inp, d_in), d_out, name)]
    if getattr(module, "bias", None) is not None:
        uses.append(Use(module.bias, None, _as_btd(grad, d_out), 1, name))
    return uses


def _is_router(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 2 and hasattr(module, "top_k") and \
        hasattr(module, "num_experts")


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


_LINEAR = Rule("linear", _linear, ("weight", "bias"))
_LINEAR_SUBCLASS = Rule("linear_subclass", _linear, ("weight", "bias"), verify=_verify_linear_subclass)
_CONV1D = Rule("hf_conv1d", _conv1d, ("weight", "bias"))
_CONV = Rule("conv", _conv, ("weight", "bias"))
_EMBEDDING = Rule("embedding", _embedding, ("weight",), check=_check_embedding)
_EMBEDDING_CALLS = Rule("embedding_calls", _embedding, ("weight",), check=_check_embedding,
                        capture=_EmbeddingCalls)
_LAYER_NORM = Rule("layer_norm", _layer_norm, ("weight", "bias"))
_EXPERTS = Rule("experts", _experts, ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                                        "down_proj_bias"), verify=_verify_experts, all_inputs=True)
_ROUTER = Rule("router", _router, ("weight", "bias"), capture=_RouterCalls)
_AFFINE_NORM = Rule("affine_norm", _affine_norm, ("weight", "bias"), verify=_verify_affine_norm)
_AFFINE_NORM_ALL = Rule("affine_norm", _affine_norm, ("weight", "bias"), verify=_verify_affine_norm, all_inputs=True)


def _more_inputs(module: nn.Module) -> bool:
    """Whether the module's ``forward`` takes inputs besides the first (a gated norm's ``gate``): its affine rule then
    re-runs the layer on every input of the call."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return True
    return len(sig.parameters) > 1


def _is_affine_candidate(module: nn.Module) -> bool:
    """A layer whose own parameters are a ``weight`` and/or ``bias`` of one shape (normalisations, layer-scale):
    a candidate for :func:`_affine_norm`, whose form is verified on the first batch. Batch normalisation is not: it
    mixes examples and writes private running statistics."""
    if isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.modules.conv._ConvNd)):
        return False
    params = dict(module.named_parameters(recurse=False))
    if not params or not set(params) <= {"weight", "bias"}:
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False  # not a leaf: e.g. BERT's LM head owns its decoder's bias (covered by the decoder's rule)
    return len({tuple(p.shape) for p in params.values()}) == 1


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s own (non-recursive) parameters, or ``None`` if no rule covers this layer type.

    Exact types first. Subclasses with their own ``forward`` are recognised by behaviour, never by name:
    ``nn.Embedding`` subclasses through their ``F.embedding`` calls (:class:`_EmbeddingCalls`), ``nn.Linear``
    subclasses and elementwise-affine layers by a check on the first batch that they compute the form their rule
    assumes (:func:`_verify_linear_subclass`, :func:`_verify_affine_norm`).
    """
    if isinstance(module, Conv1D):
        return _CONV1D
    for base, rule in ((nn.Linear, _LINEAR), (nn.Embedding, _EMBEDDING), (nn.LayerNorm, _LAYER_NORM),
                       (nn.Conv1d, _CONV), (nn.Conv2d, _CONV)):
        if isinstance(module, base) and type(module).forward is base.forward:
            return rule
    if isinstance(module, nn.Embedding):
        return _EMBEDDING_CALLS
    if _is_router(module):  # also nn.Linear subclasses (PhiMoE, Llama 4) that return (logits, weights, experts)
        return _ROUTER
    if isinstance(module, nn.Linear):
        return _LINEAR_SUBCLASS
    if _is_experts(module):
        return _EXPERTS
    if _is_affine_candidate(module):
        return _AFFINE_NORM_ALL if _more_inputs(module) else _AFFINE_NORM
    return None


def rule_parameters(rule: Rule, module: nn.Module) -> list[str]:
    """Names of ``module``'s own trainable parameters that ``rule`` covers."""
    return [n for n in rule.params if getattr(module, n, None) is not None and getattr(module, n).requires_grad]
