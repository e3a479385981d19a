"""The generic exact fallback: per-example gradients of a module's own parameters by re-running it per example.

For a module that owns trainable parameters and has no rule in ``layers.py`` (``find_rule`` is ``None``), e.g. ViT's
``cls_token`` / ``position_embeddings`` (read directly in ``ViTEmbeddings.forward``), layer-scale vectors, Funnel's
``r_w_bias``, the per-example gradient of its own parameters ``θ`` is still exact when its forward treats examples
independently: with ``y_i = f(θ, x_i)`` and ``g_i = ∂L/∂y_i`` (the module's output gradient, example ``i``'s rows),
``G_i = (∂y_i/∂θ)ᵀ g_i`` is one vector-Jacobian product of the module on example ``i`` alone. All ``B`` of them are
computed at once with ``torch.func``: ``vmap`` over ``vjp`` of ``functional_call(module, θ, x_i)`` (the approach of
Opacus' ``functorch`` grad sampler). Cost: one extra forward and backward of the module per micro-batch, under
``vmap``, and ``B × numel(θ)`` memory for the per-example gradients (they are instantiated, as a ``Use`` of kind
``"ones"`` with ``right`` of shape ``(B, 1, numel)``, so the engine's norms, clipped sums and groups apply unchanged).

Which inputs are per example: tensors whose first axis the engine proved to scale with the micro-batch (see
``ClippingEngine.first_step_check``; an input holding the examples' tokens flattened to ``(B·T, d)`` example-major,
as MoE routers get, is split into each example's ``T`` rows), otherwise those whose first axis equals the micro-batch
size; a number the probe proved to be the micro-batch size (Perceiver's ``latents.expand(batch_size, -1, -1)``) is 1
in the re-run; the others are shared by all examples. An output whose rows hold the examples' tokens flattened
example-major (a router that flattens inside its forward) is regrouped per example like such an input. A write through
a boolean mask with a broadcast value (``x[mask] = v``), which vmap cannot batch, is re-run as ``torch.where``.
Submodules keep their own rules: their parameters are constants here
(a parameter the module shares with a submodule is replaced only as the module's own attribute), and the engine's
hooks are silenced during the re-run. Before first use the module is verified on real activations: the per-example
re-run must reproduce the batched output, so a module that mixes examples (batch statistics, attention over the
batch) is refused instead of being clipped with a wrong gradient, and a module that applies dropout in training is
refused on every call (its mask cannot be replayed; the first-step checks run with dropout off).

A ruled layer's parameters that its rule does not cover get a *side* fallback (``ruled`` names the rule): the layer
re-run per example for those parameters only, next to its rule's hook for the others.

The same fallback run at an *enclosing* module (``ClippingEngine.replan``: the enclosing-module fallback) covers
parameters of its submodules that their own rules cannot see whole: ``param_names`` then holds dotted paths
(``conv1d.weight``, ``conv.parametrizations.weight.original0``), which ``functional_call`` replaces in the re-run, so
every use of the parameter inside the enclosing module's forward is differentiated; the owner's rule no longer records
it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .rules import UnsupportedLayerError

__all__ = ["Fallback", "float_outputs", "is_drop_rate", "later_batch_axis", "leaf_layout", "out_of_memory"]


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is running out of memory (``torch.OutOfMemoryError``, or what accelerate's
    ``should_reduce_batch_size`` recognises): not a failure of ``torch.func``, so re-raised as it is, never turned
    into a refusal of the layer (an untrue cause, at any step whose Poisson batch is large), and the Trainer's
    ``auto_find_batch_size`` can retry the step with smaller micro-batches."""
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(err, torch.OutOfMemoryError) or should_reduce_batch_size(err)


def is_drop_rate(key: str) -> bool:
    """A module attribute holding a random-drop probability: dropout (``attention_dropout``, ``dropout_prob``),
    LayerDrop (``layerdrop``: whole layers skipped at random in training) and stochastic depth (``drop_prob``,
    ``drop_path_rate``)."""
    return "dropout" in key or "layerdrop" in key or key.startswith("drop_p")


def later_batch_axis(big: torch.Tensor, one: torch.Tensor, b: int) -> int | None:
    """The axis ``j > 0`` that holds the examples (size ``b`` for ``b`` examples, 1 for the first alone, the first
    example's slice unchanged), when the first axis does not scale (sequence-first layouts); else ``None``."""
    if big.dim() != one.dim() or big.dim() < 2 or big.shape[0] != one.shape[0] or b == 1:
        return None
    last = big.dim() - 1 if big.is_floating_point() else big.dim()  # a float input's last axis is its features
    axes = [j for j in range(1, last) if big.shape[j] == b and one.shape[j] == 1
            and all(big.shape[k] == one.shape[k] for k in range(big.dim()) if k != j)]
    if len(axes) != 1:
        return None
    head, first = big.select(axes[0], 0), one.select(axes[0], 0)
    same = torch.allclose(head.double(), first.double(), rtol=1e-3, atol=1e-5) if one.is_floating_point() \
        else torch.equal(head, first)
    return axes[0] if same else None


def leaf_layout(big: torch.Tensor | int | None, one: torch.Tensor | int | None, b: int) -> str | int | None:
    """A fallback input's layout, from its values for ``b`` examples and for the first alone: ``"batch"``,
    ``"flat"`` (``k > 1`` rows per example, example-major), ``"size"`` (a number: ``b`` for ``b`` examples and 1 for
    one, the micro-batch size), an axis ``j > 0`` (sequence-first: the examples on axis ``j``,
    :func:`later_batch_axis`; ``nn.MultiheadAttention`` with ``batch_first=False``) or ``None`` (shared by the
    batch)."""
    if isinstance(big, int) or isinstance(one, int):
        return "size" if isinstance(big, int) and isinstance(one, int) and b > 1 and big == b and one == 1 else None
    if big is None or one is None:
        return None
    if big.shape[0] != b * one.shape[0] or big.shape[1:] != one.shape[1:]:
        return later_batch_axis(big, one, b)
    if one.shape[0] == 1:
        return "batch"
    head = big[:one.shape[0]]
    same = torch.allclose(head.double(), one.double(), rtol=1e-3, atol=1e-5) if one.is_floating_point() \
        else torch.equal(head, one)
    return "flat" if same else None


def _axis(m: str | int | None) -> int | None:
    """The later batch axis a leaf's layout names (sequence-first), or ``None``."""
    return m if isinstance(m, int) and not isinstance(m, bool) and m > 0 else None


class _MaskWrites(TorchFunctionMode):
    """Inside the per-example re-run: ``x[mask] = v`` with a boolean ``mask`` over ``x``'s leading axes and a value
    broadcast to every selected row (T5Gemma2's ``embeddings[ids == eoi] = eoi_embedding``) is written as
    ``x.copy_(torch.where(mask, v, x))``, the same values and gradients, which ``torch.func.vmap`` can batch (a
    boolean-mask write has a data-dependent shape, which it cannot). Any other write is left as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3:
            x, idx, val = args
            if (isinstance(idx, torch.Tensor) and idx.dtype == torch.bool and 0 < idx.dim() <= x.dim()
                    and idx.shape == x.shape[:idx.dim()] and isinstance(val, torch.Tensor)
                    and val.dim() <= x.dim() - idx.dim()):
                mask = idx.reshape(*idx.shape, *([1] * (x.dim() - idx.dim())))
                x.copy_(torch.where(mask, val.to(x.dtype), x))
                return None
        return func(*args, **kwargs)


def float_outputs(output) -> list[torch.Tensor]:
    """The floating-point tensors of a module's output (any nesting), in a fixed order."""
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class Fallback:
    """Per-example gradients of ``module``'s own parameters ``param_names`` (see the module docstring)."""

    def __init__(self, module: nn.Module, name: str, param_names: tuple[str, ...], ruled: str | None = None):
        self.module = module
        self.name = name
        self.param_names = param_names
        #: the name of the module's own rule when this fallback only computes the parameters that rule does not cover
        #: (a side fallback: the rule's hook still records the others, e.g. an embedding's extra vector)
        self.ruled = ruled
        #: per float output, the axis that holds the examples (set by :meth:`verify`; e.g. 1 for an LSTM's h_n), or
        #: ``"flat"`` (its rows hold the examples' tokens, example-major)
        self.out_axes: list[int | str] | None = None
        self._dropout_sites: list | None = None  # see check_dropout

    def param(self, name: str) -> nn.Parameter:
        """One of ``param_names``: the module's own (``"weight"``) or, for an enclosing module, a descendant's
        (``"conv1d.weight"``, ``"conv.parametrizations.weight.original0"``: the path ``functional_call`` replaces)."""
        return self.module.get_parameter(name)

    def describe(self) -> str:
        numel = sum(self.param(n).numel() for n in self.param_names)
        inner = [n for n in self.param_names if "." in n]
        what = f"{', '.join(self.param_names)}; {numel} values"
        if self.ruled:
            what += f"; not covered by its {self.ruled!r} rule, which records its other parameters"
        if inner:
            what += (f"; enclosing module of {', '.join(inner)}, which are used in its forward outside their own "
                     "module's (read directly, applied functionally, or broadcast over the batch), so the whole "
                     "module is re-run per example")
        return f"{self.name} ({type(self.module).__name__}: {what})"

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: self.param(n).detach() for n in self.param_names}

    def _runner(self, args: tuple, kwargs: dict, mapped: list[str | None], batch_size: int, squeeze: bool = True):
        """``f(params, per-example leaves) -> float outputs of the module on that one example``, and the per-example
        leaves stacked on a leading batch axis (``"flat"`` leaves: ``(B·k, ...)`` viewed as ``(B, k, ...)``)."""
        leaves, spec = tree_flatten((args, kwargs))
        idx = [i for i, m in enumerate(mapped) if m in ("batch", "flat") or _axis(m)]
        sizes = [i for i, m in enumerate(mapped) if m == "size"]
        flat = "flat" in mapped

        def run(params: dict[str, torch.Tensor], per_example: tuple) -> tuple[torch.Tensor, ...]:
            full = list(leaves)
            for i, x in zip(idx, per_example):
                # one example's rows / a batch of one, on the axis that holds the examples (1: sequence-first)
                full[i] = x if mapped[i] == "flat" else x.unsqueeze(_axis(mapped[i]) or 0)
            for i in sizes:
                full[i] = 1  # the micro-batch size passed as a number (Perceiver's latents.expand(batch_size, ...))
            a, k = tree_unflatten(full, spec)
            # tie_weights=False: only this module's own attribute is replaced, so a parameter it shares with a
            # submodule (BERT's MLM bias, also `decoder.bias`) counts here only for its direct uses in this forward;
            # the submodule's own hooks count its use.
            with _MaskWrites():
                out = functional_call(self.module, params, a, k, tie_weights=False, strict=False)
            outs = float_outputs(out)
            if flat or not squeeze:
                return tuple(outs)
            return tuple(t if ax == "flat" else t.squeeze(ax) for t, ax in zip(outs, self.out_axes))

        stacked = tuple(leaves[i].reshape(batch_size, -1, *leaves[i].shape[1:]) if mapped[i] == "flat" else
                        leaves[i].movedim(_axis(mapped[i]), 0) if _axis(mapped[i]) else leaves[i] for i in idx)
        if not stacked:  # only a batch-size number carries the examples: vmap needs a tensor with the batch axis
            stacked = (torch.zeros(batch_size, 0),)
            run_inner = run

            def run(params: dict[str, torch.Tensor], per_example: tuple) -> tuple[torch.Tensor, ...]:
                return run_inner(params, ())
        return run, stacked

    def per_example_outputs(self, outs: list[torch.Tensor], batch_size: int, mapped: list[str | None]) -> list:
        """The module's outputs with a leading per-example axis (rows regrouped for ``"flat"`` inputs and outputs)."""
        if "flat" in mapped:
            return [t.reshape(batch_size, -1, *t.shape[1:]) for t in outs]
        return [t.reshape(batch_size, -1, *t.shape[1:]) if ax == "flat" else t.movedim(ax, 0)
                for t, ax in zip(outs, self.out_axes)]

    def _find_out_axes(self, args: tuple, kwargs: dict, outs: list[torch.Tensor], batch_size: int,
                       mapped: list[str | None]) -> list[int | str | None]:
        """Each output's example axis: size ``B`` in the batched output and 1 when the module runs on example 0; or
        ``"flat"``: the batched output's first axis holds ``k`` rows per example, example-major, where the module
        run on example 0 gives ``k`` rows, the same as the batched output's first ``k`` (a router that flattens the
        examples' tokens to ``(B·T, d)`` inside its forward)."""
        run, per_example = self._runner(args, kwargs, mapped, batch_size, squeeze=False)
        with torch.no_grad():
            single = run(self._params(), tuple(x[0] for x in per_example))
        axes = []
        for t, o in zip(outs, single):
            cand = [j for j in range(t.dim()) if o.dim() == t.dim() and t.shape[j] == batch_size and o.shape[j] == 1
                    and all(t.shape[k] == o.shape[k] for k in range(t.dim()) if k != j)]
            if not cand and o.dim() == t.dim() >= 1 and o.shape[0] > 1 and t.shape[0] == batch_size * o.shape[0] \
                    and t.shape[1:] == o.shape[1:] and torch.allclose(
                        t[:o.shape[0]].double(), o.double(), rtol=1e-4, atol=1e-6):
                axes.append("flat")
                continue
            axes.append(0 if 0 in cand else (cand[0] if len(cand) == 1 else None))
        return axes

    @staticmethod
    def probe_layout(big: list, one: list, b: int) -> list[str | int | None]:
        """Called by the engine's first-step probe with the input leaves of a call for ``b`` examples and for the
        first alone: each leaf's :func:`leaf_layout` (what :meth:`mapped_leaves` is then given as ``known``)."""
        return [leaf_layout(x2, x1, b) for x2, x1 in zip(big, one)]

    @staticmethod
    def mapped_leaves(args: tuple, kwargs: dict, batch_size: int, known: list[str | int | None] | None = None
                      ) -> list:
        """Which leaves of ``(args, kwargs)`` carry the batch axis: ``"batch"`` (first axis B), ``"flat"`` (the
        examples' rows flattened example-major, proven by the engine's probe), ``"size"`` (a number that is the
        micro-batch size, proven by the probe: ``B`` for ``B`` examples, 1 for one; the re-run passes 1), an axis
        ``j > 0`` (sequence-first, proven by the probe: size B on axis ``j``; the re-run takes each example's slice
        there) or ``None`` (shared). Unproven, only a first axis of size B is taken for the batch axis."""
        leaves, _ = tree_flatten((args, kwargs))
        guess = ["batch" if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size else None
                 for x in leaves]
        if known is not None and len(known) == len(leaves):
            return ["size" if k == "size" and x == batch_size else
                    (k if _axis(k) and isinstance(x, torch.Tensor) and x.dim() > k and x.shape[k] == batch_size else
                     (k if k == "flat" and x.shape[0] % batch_size == 0 else (g if k == "batch" else None)))
                    for k, g, x in zip(known, guess, leaves)]
        return guess

    def _whose(self) -> str:
        """How the refusals name the parameters: the module's own, or used in its forward outside their module's."""
        own = [n for n in self.param_names if "." not in n]
        inner = [n for n in self.param_names if "." in n]
        parts = ([f"owns trainable parameters ({', '.join(own)})"] if own else []) + (
            [f"uses trainable parameters of its submodules outside their own forward ({', '.join(inner)})"]
            if inner else [])
        if self.ruled:
            return " and ".join(parts) + f" that its {self.ruled!r} rule does not cover"
        return " and ".join(parts) + " that hf_dp has no rule for"

    def _enclosable(self, err: UnsupportedLayerError) -> UnsupportedLayerError:
        """Mark a refusal that re-running a larger module might resolve (the engine's first-step re-planning tries
        the enclosing modules before refusing): the qualified names of the parameters concerned."""
        err.enclosable = [f"{self.name}.{n}" if self.name else n for n in self.param_names]
        return err

    def check_dropout(self) -> None:
        """Refuse (``UnsupportedLayerError``) if the module applies dropout in this call: its random mask cannot be
        reproduced by the per-example re-run, so the re-run's gradient would not be the example's. Checked on every
        call (the first-step checks run with dropout off, training does not): ``nn.Dropout`` modules in train mode
        with ``p > 0``, and float attributes named as drop probabilities (``attention_dropout``, passed to
        ``F.dropout`` or sdpa when ``self.training``; LayerDrop's ``layerdrop``, which skips whole layers at random;
        stochastic depth's ``drop_prob``: :func:`is_drop_rate`) on modules in train mode. Dropout read elsewhere (e.g.
        from the config at forward time) is caught by :meth:`verify`'s comparison."""
        if self._dropout_sites is None:  # the modules and attributes to look at, found once
            self._dropout_sites = [(f"{self.name}.{n}" if n else self.name, m,
                                    [k for k, v in vars(m).items() if is_drop_rate(k) and isinstance(v, float)])
                                   for n, m in self.module.named_modules()]
        active = []
        for where, m, keys in self._dropout_sites:
            if not m.training:
                continue
            if isinstance(m, nn.modules.dropout._DropoutNd):
                if m.p > 0:
                    active.append(f"{where} (p={m.p})")
                continue
            active += [f"{where}.{k}={getattr(m, k)}" for k in keys
                       if isinstance(getattr(m, k, None), float) and getattr(m, k) > 0]
        if active:
            inner = [n for n in self.param_names if "." in n]
            raise UnsupportedLayerError(
                f"{self.name} ({type(self.module).__name__}) is re-run per example by hf_dp's generic fallback to get "
                f"the per-example gradients of {', '.join(self.param_names)}"
                + (" (used in its forward outside their own module's)" if inner else "")
                + f", but it applies dropout ({', '.join(active)}), whose random mask a re-run cannot reproduce. "
                "Set that dropout probability to 0 (in the config, e.g. attention_dropout=0.0 / "
                "hidden_dropout_prob=0.0, or on the module), freeze these parameters, or use a PEFT adapter (LoRA)."
            )

    def verify(self, args: tuple, kwargs: dict, output, batch_size: int, mapped: list[str | None]) -> None:
        """Refuse (``UnsupportedLayerError``) unless the per-example re-run reproduces the batched output."""
        outs = float_outputs(output)
        cls = type(self.module).__name__
        rows = "flat" in mapped
        if rows:
            bad = [tuple(t.shape) for t in outs if t.dim() == 0 or t.shape[0] % batch_size]
        else:
            try:
                axes = self._find_out_axes(args, kwargs, outs, batch_size, mapped)
            except Exception:  # noqa: BLE001 - reported below as a failed re-run
                axes = [0] * len(outs)
            bad = [tuple(t.shape) for t, ax in zip(outs, axes) if ax is None]
            self.out_axes = axes
        if bad:
            sequence_first = [f"{self.name}.{n}" if n else self.name for n, m in self.module.named_modules()
                              if getattr(m, "batch_first", None) is False]
            if sequence_first and all(len(shape) > 1 and shape[1] == batch_size for shape in bad):
                # its examples would be on axis 1, which the first step's probe did not prove (leaf_layout)
                raise self._enclosable(UnsupportedLayerError(
                    f"{self.name} ({cls}) {self._whose()}, and it is built with batch_first=False "
                    f"({', '.join(sequence_first)}): its inputs and output are sequence-first, (length, batch, "
                    f"features) (output shapes {bad} for a micro-batch of {batch_size}), and the first step did not "
                    "prove that the second axis of its inputs holds the examples (hf_dp re-runs it per example along "
                    "that axis only where the run on the micro-batch and on its first example alone show size "
                    f"{batch_size} and 1 there, with the first example's slice the same in both). Here it is not: "
                    "something before this module mixes the examples (e.g. a statistic over the batch axis), or its "
                    "inputs do not hold one example per position of that axis. Make its inputs depend on each "
                    "example alone, freeze these parameters (requires_grad_(False)), or train the model through a "
                    "PEFT adapter (LoRA)."
                ))
            raise self._enclosable(UnsupportedLayerError(
                f"{self.name} ({cls}) {self._whose()}, and its output has no per-example axis (output shapes "
                f"{bad} for a micro-batch of {batch_size}), "
                "so its per-example gradients cannot be computed by re-running it per example. Freeze these "
                "parameters (requires_grad_(False)) or train the model through a PEFT adapter (LoRA)."
            ))
        run, per_example = self._runner(args, kwargs, mapped, batch_size)
        outs = self.per_example_outputs(outs, batch_size, mapped)
        try:
            with torch.no_grad():
                again = vmap(run, in_dims=(None, 0), randomness="different")(self._params(), per_example)
        except Exception as err:  # noqa: BLE001 - any failure of the per-example re-run is a refusal
            if out_of_memory(err):
                raise
            # not enclosable: a larger module would run the same operation under vmap
            raise UnsupportedLayerError(
                f"{self.name} ({cls}) {self._whose()}, and re-running it on one example at a time under "
                f"torch.func.vmap failed ({type(err).__name__}: "
                f"{err}): either its forward mixes examples (batch statistics, e.g. BatchNorm in train mode) or "
                "torch.func does not support one of its operations. Freeze these parameters or use a PEFT adapter "
                "(LoRA)."
            ) from err
        tol = 1e-2 if any(t.dtype in (torch.float16, torch.bfloat16) for t in outs) else 1e-4
        for ref, got in zip(outs, again):
            if not torch.allclose(got.to(ref.dtype).reshape(ref.shape), ref, rtol=tol, atol=tol):
                raise self._enclosable(UnsupportedLayerError(
                    f"{self.name} ({cls}) {self._whose()}, and its output on a micro-batch differs from its "
                    "output on each example alone: it mixes "
                    "examples (batch statistics such as BatchNorm in train mode, or anything computed across the "
                    "batch), or it is random (e.g. dropout applied functionally with a probability hf_dp cannot see, "
                    "such as one read from the config in the forward: set it to 0). Per-example clipping cannot bound "
                    "an example's contribution through it. Freeze these parameters (requires_grad_(False)) or use a "
                    "PEFT adapter (LoRA)."
                ))

    def per_example_grads(self, args: tuple, kwargs: dict, grads: list[torch.Tensor | None], outputs_like:
                          list[torch.Tensor], mapped: list[str | None], batch_size: int) -> dict[str, torch.Tensor]:
        """``{param: (B, numel)}``: ``G_i = (∂y_i/∂θ)ᵀ g_i`` for every example, by ``vmap(vjp)``."""
        run, per_example = self._runner(args, kwargs, mapped, batch_size)
        grads = tuple(torch.zeros_like(o) if g is None else g.to(o.dtype) for g, o in zip(grads, outputs_like))
        grads = tuple(self.per_example_outputs(list(grads), batch_size, mapped))

        def one(xs: tuple, gs: tuple) -> dict[str, torch.Tensor]:
            _, pull = vjp(lambda p: run(p, xs), self._params())
            return pull(gs)[0]

        try:
            with torch.enable_grad():
                out = vmap(one, randomness="different")(per_example, grads)
        except Exception as err:  # noqa: BLE001 - as a failed re-run of the forward: a refusal naming the module
            if out_of_memory(err):
                raise
            raise UnsupportedLayerError(
                f"{self.name} ({type(self.module).__name__}) {self._whose()}, and differentiating it on one example at "
                f"a time under torch.func.vmap failed ({type(err).__name__}: {str(err)[:300]}): torch.func does not "
                "support an operation of its backward (e.g. a sparse tensor). Freeze these parameters or use a PEFT "
                "adapter (LoRA)."
            ) from err
        return {n: g.reshape(g.shape[0], -1) for n, g in out.items()}
