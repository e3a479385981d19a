"""The mixture-of-experts family: transformers 5 expert blocks (3-D expert parameters, :func:`_experts`) and routers
(a 2-D ``weight`` scoring tokens for experts, whose ``F.linear`` call gets the linear rule: :class:`RouterCalls`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .base import Attach, Rule, UnsupportedLayerError, Use, as_btd, close
from .calls import WeightCalls
from .registry import register_builtin

__all__ = ["RouterCalls"]


class RouterCalls(WeightCalls):
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
            ok = close(_experts_recompute(module, x, idx, weights, _expert_params(module)), out, tol)
            if ok:
                gen = torch.Generator(device=x.device).manual_seed(0)
                rand = {n: torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 0.1
                        for n, p in module.named_parameters(recurse=False)}
                clone = copy.copy(module)
                clone._parameters = {n: nn.Parameter(v, requires_grad=False) for n, v in rand.items()}
                ok = close(_experts_recompute(module, x, idx, weights, _expert_params(module, rand)),
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
    uses = [Use(module.weight, as_btd(grad, d_out), as_btd(inp, d_in), d_out, name)]
    if getattr(module, "bias", None) is not None:
        uses.append(Use(module.bias, None, as_btd(grad, d_out), 1, name))
    return uses


def _is_router(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 2 and hasattr(module, "top_k") and \
        hasattr(module, "num_experts")


_EXPERTS = Rule("experts", _experts, ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                                        "down_proj_bias"), verify=_verify_experts, all_inputs=True)
_ROUTER = Rule("router", _router, ("weight", "bias"), capture=RouterCalls)

# also nn.Linear subclasses (PhiMoE, Llama 4) that return (logits, weights, experts): before "linear_subclass"
register_builtin("router", lambda m: _ROUTER if _is_router(m) else None)
register_builtin("experts", lambda m: _EXPERTS if _is_experts(m) else None)
