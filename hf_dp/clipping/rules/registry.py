"""The layer-rule registry: which :class:`~.base.Rule` factors a module's per-example gradients.

Dispatch is an ordered list, first match wins, as PEFT dispatches layer types (``peft/tuners/lora/model.py``,
``_create_new_module``: the user's dispatchers first, the built-in ones after, the default last):

1. the user's rules (:func:`register_layer_rule`), in the order they were registered;
2. the built-in rules, in :data:`BUILTIN_ORDER`, each registered on import by its family's module (``linear.py``,
   ``embedding.py``, ``norms.py``, ``conv.py``, ``moe.py``) with :func:`register_builtin`;
3. no match: ``None`` — the engine then re-runs the module per example (the generic fallback, ``fallback.py``).

A user rule is trusted no more than a built-in one. The engine's first-step checks apply to it (the batch axis of
its input proven on 1 and B examples; the hooks' sum of per-example gradients equal to autograd's gradient), and on
its first call the registry checks its factors' shapes, that example 0's gradient from them equals autograd's for
the layer's own ``forward`` re-run on example 0, and that it keeps examples apart (example 0's gradient from the
micro-batch equals the one from its rows alone). A rule that fails any of these is refused with
:class:`~.base.UnsupportedLayerError`, naming it, before the first update.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .base import Rule, RuleFn, UnsupportedLayerError, Use, close

__all__ = ["BUILTIN_ORDER", "RegisteredRule", "find_rule", "layer_rule_names", "own_forward", "register_builtin",
           "register_layer_rule", "rule_parameters", "unregister_layer_rule"]

#: The built-in rules, in dispatch order (after the user's rules). Exact types first; subclasses with their own
#: ``forward`` are recognised by behaviour, never by name: ``nn.Embedding`` subclasses through their ``F.embedding``
#: calls (``embedding_calls``), ``nn.Linear`` subclasses and elementwise-affine layers by a check on the first batch
#: that they compute the form their rule assumes (``linear_subclass``, ``affine_norm``). The router comes before
#: ``linear_subclass`` (PhiMoE's and Llama 4's routers subclass ``nn.Linear``).
BUILTIN_ORDER = ("hf_conv1d", "linear", "embedding", "layer_norm", "conv", "embedding_calls", "router",
                 "linear_subclass", "experts", "affine_norm")

#: What the engine calls a module without a rule (its plan entries); no rule may take that name.
_RESERVED = frozenset(BUILTIN_ORDER) | {"fallback"}

Dispatch = Callable[[nn.Module], "Rule | None"]

_builtin: dict[str, Dispatch] = {}
_user: dict[str, RegisteredRule] = {}  # registration order is dispatch order


def own_forward(cls: type[nn.Module]) -> Callable[[nn.Module], bool]:
    """A matcher for instances of ``cls`` that run ``cls``'s own ``forward`` (``cls`` itself, or a subclass that does
    not override it): a subclass with a ``forward`` of its own may compute something else."""
    def matches(module: nn.Module) -> bool:
        return isinstance(module, cls) and type(module).forward is cls.forward

    matches.__qualname__ = f"own_forward({cls.__qualname__})"
    return matches


def register_builtin(name: str, dispatch: Dispatch) -> None:
    """Register a built-in rule family's dispatcher ``module -> Rule | None`` under its place in
    :data:`BUILTIN_ORDER` (called once by each family module on import)."""
    if name not in BUILTIN_ORDER:
        raise ValueError(f"{name!r} is not a built-in rule (BUILTIN_ORDER lists them in dispatch order).")
    if name in _builtin:
        raise ValueError(f"the built-in rule {name!r} is already registered.")
    _builtin[name] = dispatch


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s own (non-recursive) parameters, or ``None`` if no rule covers this layer: the first
    match among the user's rules (in registration order), then among the built-in ones (:data:`BUILTIN_ORDER`)."""
    if len(_builtin) != len(BUILTIN_ORDER):  # a family module was not imported: a rule would be silently missing
        missing = [n for n in BUILTIN_ORDER if n not in _builtin]
        raise RuntimeError(f"hf_dp's built-in layer rules {missing} are not registered; import hf_dp.clipping.rules.")
    for entry in _user.values():
        if entry.matches(module):
            return entry.rule
    for name in BUILTIN_ORDER:
        rule = _builtin[name](module)
        if rule is not None:
            return rule
    return None


def rule_parameters(rule: Rule, module: nn.Module) -> list[str]:
    """Names of ``module``'s own trainable parameters that ``rule`` covers."""
    return [n for n in rule.params if getattr(module, n, None) is not None and getattr(module, n).requires_grad]


def layer_rule_names() -> list[str]:
    """The rules' names in dispatch order: the user's, then the built-in ones."""
    return [*_user, *BUILTIN_ORDER]


# ------------------------------------------------------------------------------------------------- the user's rules
@dataclass(frozen=True)
class RegisteredRule:
    """A registered user rule (returned by :func:`register_layer_rule`). ``remove()`` unregisters it; as a context
    manager it is unregistered on exit (``with register_layer_rule(...):``), so a test leaks no rule into the next."""

    name: str
    matches: Callable[[nn.Module], bool]
    rule: Rule
    layer_type: type[nn.Module] | None = None  # ``matches`` when it was given as a class

    def remove(self) -> None:
        """Unregister this rule (nothing happens if it is no longer registered)."""
        if _user.get(self.name) is self:
            del _user[self.name]

    def __enter__(self) -> RegisteredRule:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def register_layer_rule(matches: type[nn.Module] | Callable[[nn.Module], bool], factor: RuleFn, *,
                        params: tuple[str, ...] | str = ("weight", "bias"), name: str | None = None,
                        verify: Callable[[nn.Module, str, torch.Tensor, torch.Tensor], None] | None = None,
                        ) -> RegisteredRule:
    """Register a per-example gradient rule for your own layer type; it takes precedence over the built-in rules.

    Args:
        matches: a layer class — its instances that run its own ``forward`` match (a subclass with a ``forward`` of
            its own does not: pass a function to match more) — or a function ``module -> bool``.
        factor: ``factor(module, name, inp, out, grad) -> list[Use]``, called in the backward pass for each call of
            a matching module, with ``inp`` its first input and ``grad`` the gradient of its output, both with the
            examples on the first axis (``B``), and ``name`` its qualified name (for :class:`Use`'s
            ``module_name``); ``out`` is the layer's output or ``None`` (the engine does not keep it): do not rely
            on it. For each parameter it covers, it returns a :class:`Use` whose per-example gradient
            ``G_i = L_iᵀ R_i`` (reshaped to the parameter's shape) is that parameter's gradient from example ``i``
            in this call: ``left`` ``(B, T, d_L)`` dense, ``(B, T)`` row indices of a one-hot ``L`` (lookups), or
            ``None`` (all ones, ``d_L = 1``: ``G_i = Σ_t R_{i,t}``); ``right`` ``(B, T, d_R)``. ``T`` is any number
            of rows per example (tokens, positions). This is the factorisation ghost clipping needs (Li et al.
            2022, §4 and App. F).
        params: the names of the module's own parameters the rule covers (a trainable parameter it does not cover
            is re-run per example by the generic fallback).
        name: the rule's name (in logs and refusals); default: the class's name. Required when ``matches`` is a
            function. Must not be taken by a built-in or registered rule.
        verify: optional ``verify(module, name, inp, out)``, run once per module on its first call in training,
            which raises :class:`UnsupportedLayerError` if the layer does not compute the form the rule assumes.

    Returns:
        A :class:`RegisteredRule`: ``.remove()`` unregisters it; ``with register_layer_rule(...):`` registers it for
        the block only.

    A registered rule is checked, never trusted: on its first call per module, example 0's gradient from its factors
    must equal autograd's for the layer's own ``forward`` re-run on example 0 (layers without parametrised children)
    and, on two or more examples, the one from example 0's rows alone; at the first step the engine also proves its
    input's batch axis and compares the sum of its per-example gradients with autograd's gradient. A rule that fails
    is refused with :class:`UnsupportedLayerError` before any update is released. A rule sees the layer's first
    input only; for a layer whose parameters meet several inputs, do not register a rule: the generic fallback
    re-runs it per example, exactly.
    """
    if isinstance(matches, type):
        if not issubclass(matches, nn.Module):
            raise TypeError(f"matches={matches.__qualname__}: a layer rule matches nn.Module subclasses.")
        cls, match = matches, own_forward(matches)
        name = cls.__qualname__ if name is None else name
    elif callable(matches):
        cls, match = None, matches
        if name is None:
            raise ValueError("register_layer_rule(matches=<function>, ...) needs name=: the rule's name in logs and "
                             "refusals.")
    else:
        raise TypeError(f"matches must be an nn.Module subclass or a function module -> bool, not {matches!r}.")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, not {name!r}.")
    if name in _RESERVED:
        raise ValueError(f"{name!r} is the name of a built-in rule; give your rule another name.")
    if name in _user:
        raise ValueError(f"a layer rule named {name!r} is already registered; unregister it first "
                         f"(its handle's .remove(), or hf_dp.unregister_layer_rule({name!r})).")
    other = next((e.name for e in _user.values() if cls is not None and e.layer_type is cls), None)
    if other is not None:
        raise ValueError(f"{cls.__qualname__} already has a registered rule ({other!r}); unregister it first.")
    if not callable(factor):
        raise TypeError(f"factor must be a function (module, name, inp, out, grad) -> list[Use], not {factor!r}.")
    if verify is not None and not callable(verify):
        raise TypeError(f"verify must be a function (module, name, inp, out) -> None or None, not {verify!r}.")
    params = (params,) if isinstance(params, str) else tuple(params)
    if not params or not all(isinstance(p, str) and p for p in params):
        raise ValueError(f"params must name the module's parameters the rule covers, not {params!r}.")
    rule = Rule(name, _checked(name, factor, params), params, verify=verify)
    entry = RegisteredRule(name, match, rule, cls)
    _user[name] = entry
    return entry


def unregister_layer_rule(name: str) -> None:
    """Unregister the user rule ``name`` (``KeyError`` if there is none)."""
    if name not in _user:
        raise KeyError(f"no user layer rule named {name!r} is registered (registered: {list(_user)}).")
    del _user[name]


def _checked(rule_name: str, factor: RuleFn, params: tuple[str, ...]) -> RuleFn:
    """``factor`` with the checks a user rule gets: on every call, its uses are :class:`Use` of the module's own
    covered parameters, with one row block per example and a gradient of the parameter's size; on its first call per
    module, example 0's gradient equals the one from its rows alone (:func:`_check_kept_apart`, with two or more
    examples: the more specific refusal for a rule that mixes examples) and autograd's for the layer re-run on
    example 0 (:func:`_check_against_layer`; not for a layer with parametrised children, whose re-run would fire the
    engine's hooks on them)."""
    against_layer: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    kept_apart: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    label = f"the layer rule {rule_name!r} (registered with hf_dp.register_layer_rule)"

    def uses(module: nn.Module, name: str, inp, out, grad: torch.Tensor) -> list[Use]:
        result = factor(module, name, inp, out, grad)
        b = grad.shape[0]
        _check_uses(result, module, name, params, b, label)
        if module in kept_apart and module in against_layer:
            return result
        if not isinstance(inp, torch.Tensor) or not inp.dim() or inp.shape[0] != b:
            raise UnsupportedLayerError(
                f"{name} ({type(module).__name__}): {label} needs the layer's first input to be a tensor with the "
                "examples on its first axis, as its output gradient has; this call's is not. Unregister the rule "
                "(the generic fallback then re-runs the layer per example) or freeze the layer.")
        if module not in kept_apart and b >= 2:
            alone = factor(module, name, inp[:1], out[:1] if isinstance(out, torch.Tensor) and out.dim() and
                           out.shape[0] == b else out, grad[:1])
            _check_uses(alone, module, name, params, 1, label)
            _check_kept_apart(result, alone, module, name, b, label)
            kept_apart.add(module)
        if module not in against_layer:
            if not any(True for m in module.modules() if m is not module for _ in m.parameters(recurse=False)):
                _check_against_layer(result, module, name, params, inp, grad, label)
            against_layer.add(module)
        return result

    uses.__qualname__ = getattr(factor, "__qualname__", rule_name)
    return uses


def _check_uses(uses, module: nn.Module, name: str, params: tuple[str, ...], b: int, label: str) -> None:
    def refuse(what: str):
        return UnsupportedLayerError(
            f"{name} ({type(module).__name__}): {label} {what}, so its per-example gradients cannot be formed. Fix "
            "the rule, or unregister it (the generic fallback then re-runs the layer per example).")

    if not isinstance(uses, (list, tuple)) or not all(isinstance(u, Use) for u in uses):
        raise refuse(f"returned {type(uses).__name__}, not a list of hf_dp.Use")
    covered = [getattr(module, p, None) for p in params]
    for u in uses:
        if not any(u.param is p for p in covered if p is not None):
            raise refuse(f"returned a Use for a parameter that is not one of the layer's own {', '.join(params)}")
        u = u.by_example(b)
        r, left = u.right, u.left
        if r.dim() != 3 or r.shape[0] != b:
            raise refuse(f"returned a right factor of shape {tuple(r.shape)}, not (B={b}, T, d_R)")
        if u.kind == "dense":
            ok = left.dim() == 3 and left.shape[:2] == r.shape[:2] and left.shape[2] == u.left_dim
            size = u.left_dim * r.shape[2]
        elif u.kind == "index":
            ok, size = left.dim() == 2 and left.shape == r.shape[:2], u.left_dim * r.shape[2]
        else:
            ok, size = u.left_dim == 1, r.shape[2]
        if not ok:
            raise refuse(f"returned a left factor of shape {None if left is None else tuple(left.shape)} (left_dim "
                         f"{u.left_dim}) for a right factor of shape {tuple(r.shape)}")
        if size != u.param.numel():
            raise refuse(f"returned factors whose per-example gradient has {size} values for a parameter of shape "
                         f"{tuple(u.param.shape)}")


def _per_param(uses: list[Use], n: int, i: int = 0) -> dict[int, torch.Tensor]:
    """Example ``i``'s gradient of each parameter (by ``id``) from the rule's uses on ``n`` examples, flat, float64."""
    out: dict[int, torch.Tensor] = {}
    for u in uses:
        g = _example_gradient(u.by_example(n), i)
        out[id(u.param)] = out[id(u.param)] + g if id(u.param) in out else g
    return out


def _differs(got: torch.Tensor | None, ref: torch.Tensor | None, tol: float) -> str | None:
    """``None`` when ``got`` equals ``ref`` to ``tol`` (relative to ``ref``'s largest entry; missing = zeros), else
    a description of the difference."""
    if got is None and ref is None:
        return None
    ref = torch.zeros_like(got) if ref is None else ref
    got = torch.zeros_like(ref) if got is None else got
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    if torch.allclose(got, ref, rtol=tol, atol=tol * scale + 1e-30):
        return None
    return f"largest difference {float((got - ref).abs().max()):.3g}, gradient scale {scale:.3g}"


def _tolerance(uses: list[Use]) -> float:
    return 1e-2 if any(u.right.dtype in (torch.float16, torch.bfloat16) for u in uses) else 1e-5


def _check_against_layer(batched: list[Use], module: nn.Module, name: str, params: tuple[str, ...],
                         inp: torch.Tensor, grad: torch.Tensor, label: str) -> None:
    """Example 0's gradient of each covered parameter, from the rule's factors on this call, equals autograd's
    gradient of the layer's own ``forward`` re-run on example 0's input (parameters replaced by stand-ins, no hooks
    run) against example 0's output gradient: the rule is exact for this example, not only summed over the batch
    (the engine's check). A rule for a layer nested in a block is thereby refused naming itself, rather than its
    parameters' gradients being moved to the block's re-run per example. Random layers (two re-runs differ) are
    refused: a rule cannot know their draws."""
    own = {p: getattr(module, p) for p in params if isinstance(getattr(module, p, None), nn.Parameter)}
    stand_in = {p: nn.Parameter(v.detach(), requires_grad=True) for p, v in own.items()}
    clone = copy.copy(module)  # shares everything but the parameter dict; .forward runs no hook of the module
    clone._parameters = {**module._parameters, **stand_in}
    x, g = inp[:1].detach(), grad[:1].detach()
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            y = clone.forward(x)
            with torch.no_grad():
                again = clone.forward(x)
            if not isinstance(y, torch.Tensor) or y.numel() != g.numel():
                raise TypeError(f"its output for one example is not one tensor of {g.numel()} values")
            refs = torch.autograd.grad(y, list(stand_in.values()), g.reshape(y.shape).to(y.dtype), allow_unused=True)
    except Exception as err:  # noqa: BLE001 - reported as the cause of the refusal
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}): {label} could not be checked: re-running the layer's forward on "
            f"example 0's first input failed ({type(err).__name__}: {err}). A rule gets the layer's first input "
            "only; for a layer that needs more, unregister the rule (the generic fallback then re-runs it per "
            "example).") from err
    if not close(again, y.detach(), 1e-2 if y.dtype in (torch.float16, torch.bfloat16) else 1e-4):
        raise UnsupportedLayerError(
            f"{name} ({type(module).__name__}): re-running the layer on the same input gives another output (it "
            f"draws random numbers, e.g. dropout), which {label} cannot know from its input and output gradient. "
            "Switch the randomness off in that layer, or unregister the rule.")
    tol = _tolerance(batched)
    mine = _per_param(batched, grad.shape[0])
    for (p, param), ref in zip(own.items(), refs):
        what = _differs(mine.get(id(param)), None if ref is None else ref.double().reshape(-1), tol)
        if what is not None:
            raise UnsupportedLayerError(
                f"{name} ({type(module).__name__}): {label} gives example 0 a gradient of {p!r} that differs from "
                f"autograd's for the layer re-run on that example ({what}): the rule's factors are wrong (e.g. a "
                "missing factor, a transposition). Fix the rule, or unregister it (the generic fallback then re-runs "
                "the layer per example).")


def _example_gradient(use: Use, i: int) -> torch.Tensor:
    """Example ``i``'s ``L_iᵀ R_i``, flattened, in float64."""
    r = use.right[i].double()
    if use.kind == "ones":
        return r.sum(0)
    if use.kind == "index":
        return r.new_zeros(use.left_dim, r.shape[-1]).index_add_(0, use.left[i].long(), r).reshape(-1)
    return (use.left[i].double().t() @ r).reshape(-1)


def _check_kept_apart(batched: list[Use], alone: list[Use], module: nn.Module, name: str, b: int, label: str) -> None:
    """Example 0's gradient of each parameter, from the rule's factors on the micro-batch, equals the one from its
    factors on example 0's rows alone: a rule that mixes examples (a sum or mean over the batch axis, rows assigned to
    the wrong example) would keep the batch's total right, which the engine's hooks-vs-autograd check compares, while
    clipping each example's gradient wrongly."""
    tol = _tolerance(batched)
    first, own = _per_param(batched, b), _per_param(alone, 1)
    for pid in first.keys() | own.keys():
        what = _differs(first.get(pid), own.get(pid), tol)
        if what is not None:
            raise UnsupportedLayerError(
                f"{name} ({type(module).__name__}): {label} gives example 0 a different gradient in a micro-batch of "
                f"{b} than from its rows alone ({what}): it mixes examples (e.g. a sum or mean over the batch axis), "
                "so per-example clipping would not bound one example's contribution. Compute each example's factors "
                "from its own rows (the first axis), or unregister the rule (the generic fallback then re-runs the "
                "layer per example).")
