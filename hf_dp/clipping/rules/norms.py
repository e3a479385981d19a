"""The normalisation family: ``nn.LayerNorm`` (its own ``forward``) and elementwise-affine layers ``y = w ⊙ x̂ + b +
y(0, 0)`` (RMSNorm and the other norms of transformers, layer scale, gated norms, ConvNeXt V2's ``GRN``), whose form
is verified on the first batch by re-running the layer itself (:func:`_verify_affine_norm`)."""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .base import Rule, UnsupportedLayerError, Use, as_btd, call_inputs, close, run_with_params
from .registry import own_forward, register_builtin

__all__: list[str] = []


def _layer_norm(module: nn.LayerNorm, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y = w ⊙ x̂ + b`` with ``x̂`` the normalised input: ``G_w = Σ_t g ⊙ x̂``, ``G_b = Σ_t g``."""
    d = module.weight.numel() if module.weight is not None else module.bias.numel()
    x_hat = F.layer_norm(inp, module.normalized_shape, None, None, module.eps)
    g = as_btd(grad, d)
    uses = []
    if module.weight is not None:
        uses.append(Use(module.weight, None, g * as_btd(x_hat, d).to(g.dtype), 1, name))
    if module.bias is not None:
        uses.append(Use(module.bias, None, g, 1, name))
    return uses


_AFFINE_FORM: weakref.WeakKeyDictionary[nn.Module, tuple[float, int, bool]] = weakref.WeakKeyDictionary()


def _first_rows(inputs: tuple, rows: int) -> tuple:
    """The call's inputs restricted to the first ``rows`` rows of the first input (inputs with its first axis)."""
    n = inputs[0].shape[0]
    return tuple(a[:rows] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n else a for a in inputs)


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
        return (run_with_params(module, x, torch.ones_like(w), zero_b)
                - run_with_params(module, x, torch.zeros_like(w), zero_b))
    return run_with_params(module, x, None if w is None else torch.full_like(w, 1.0 - offset), zero_b)


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
    g = as_btd(grad.movedim(axis, -1), d)
    uses = []
    if w is not None:
        x_hat = _unit_output(module, inp, offset, additive).movedim(axis, -1)
        uses.append(Use(w, None, g * as_btd(x_hat, d).to(g.dtype), 1, name, token_rows=rows))
    if b is not None:
        uses.append(Use(b, None, g, 1, name, token_rows=rows))
    return uses


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
    inputs = call_inputs(inp)
    with torch.no_grad():
        zero_b = None if b is None else torch.zeros_like(b)
        zero_w = None if w is None else torch.zeros_like(w)
        y0 = run_with_params(module, inp, zero_w, zero_b)
        x_hat, offset, additive = None, 0.0, False
        if w is not None:
            x_hat = run_with_params(module, inp, torch.ones_like(w), zero_b) - y0
            offset = round(float((y0 * x_hat).sum() / (x_hat * x_hat).sum().clamp(min=1e-30)), 6)
            additive = not close(y0, offset * x_hat, tol)
            offset = 0.0 if additive else offset
        gen = torch.Generator(device=p.device).manual_seed(0)
        w_r = None if w is None else torch.rand(w.shape, generator=gen, device=p.device, dtype=p.dtype) + 0.5
        b_r = None if b is None else torch.randn(b.shape, generator=gen, device=p.device, dtype=p.dtype)
        y_r = run_with_params(module, inp, w_r, b_r)
        alone = inputs[0].shape[0] < 2
        if not alone:
            first = _first_rows(inputs, 1)
            first = first if isinstance(inp, tuple) else first[0]
            alone = close(run_with_params(module, first, zero_w, zero_b), y0[:1], tol) and (
                w is None or close(_unit_output(module, first, offset, additive), x_hat[:1], tol))
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

            if alone and close(form(w, b), out, tol) and close(y_r, form(w_r, b_r), tol):
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


_LAYER_NORM = Rule("layer_norm", _layer_norm, ("weight", "bias"))
_AFFINE_NORM = Rule("affine_norm", _affine_norm, ("weight", "bias"), verify=_verify_affine_norm)
_AFFINE_NORM_ALL = Rule("affine_norm", _affine_norm, ("weight", "bias"), verify=_verify_affine_norm, all_inputs=True)


def _affine_dispatch(module: nn.Module) -> Rule | None:
    if not _is_affine_candidate(module):
        return None
    return _AFFINE_NORM_ALL if _more_inputs(module) else _AFFINE_NORM


_is_plain_layer_norm = own_forward(nn.LayerNorm)
register_builtin("layer_norm", lambda m: _LAYER_NORM if _is_plain_layer_norm(m) else None)
register_builtin("affine_norm", _affine_dispatch)
