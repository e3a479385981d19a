"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): exact per-example gradients by back-propagation through
time on the batch.

``torch.func`` has no batching rule for PyTorch's fused recurrent kernels, so the generic fallback (``fallback.py``:
``vmap`` over ``vjp`` of the module's own forward) cannot re-run them per example. But a recurrent layer never mixes
the rows of its batch, and every use of its weights is a linear map applied at each time step:

* ``gi_t = W_ih x_t + b_ih`` (one matrix product over all steps of a layer and direction),
* ``gh_t = W_hh h_{t-1} + b_hh`` (one per step),
* LSTM with ``proj_size``: ``h_t = W_hr m_t`` with ``m_t = o_t ⊙ tanh(c_t)``,

so example ``i``'s gradient is ``G_i(W_ih) = Σ_t ∂L_i/∂gi_{i,t}ᵀ x_{i,t}``, ``G_i(W_hh) = Σ_t ∂L_i/∂gh_{i,t}ᵀ
h_{i,t-1}``, ``G_i(b) = Σ_t ∂L_i/∂g_{i,t}`` — the same ``Lᵀ R`` factorisation as a ``Linear`` over ``T`` tokens
(``layers.Use``), so ghost norms and book-keeping apply unchanged (Li et al. 2022, §4; Opacus' RNN grad sampler
(``opacus/layers/dp_rnn.py``) gets the same factors by rebuilding the layer from ``Linear`` cells). The factors come
from a functional twin of the layer written in plain tensor ops (PyTorch's gate equations: LSTM ``i, f, g, o``; GRU
``r, z, n`` with ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``; Elman ``tanh``/``relu``), run once on the whole
micro-batch: its output gradient (the module's, from the engine's hook) is back-propagated through time to every
``gi`` (and projected ``h``) by one ``torch.autograd.grad`` call; ``∂L/∂gh_t = ∂L/∂gi_t`` since the two are added
(for the GRU's ``n`` gate, ``r_t ⊙`` it). Since the rows of the batch never interact, row ``i`` of those gradients is
example ``i``'s own. No loop over examples, a loop over time steps. Cost: one extra forward and backward of the layer
per micro-batch in Python tensor ops rather than PyTorch's fused kernel (on CPU, a DP micro-batch through a 2-layer
bidirectional LSTM costs about 3× its plain forward + backward, a GRU about 1.6×, a ``Linear`` stack 1.3–1.5×), and
the factors ``(B, T, 4H)``, ``(B, T, d)`` kept like a ``Linear``'s.

``PackedSequence`` inputs (``pack_padded_sequence(..., enforce_sorted=False)``) are exact: the twin runs on the padded
batch in the caller's order and a step past a sequence's own length leaves its state unchanged. The batch axis is
proven at the first step (:meth:`RecurrentFallback.probe_layout`): it has ``B`` rows for ``B`` examples and one for
the first alone (or ``k`` rows per example, example-major).

The twin is verified on the first micro-batch against the module's real output (all of ``output``, ``h_n``, ``c_n``):
a layer it does not reproduce is refused. Refused, each with its cause: dropout between layers in train mode (its
random mask lives inside PyTorch's kernel and cannot be replayed), a ``PackedSequence`` packed with
``enforce_sorted=True`` (in the caller's length order, which cannot be matched to the examples) or whose sequences are
not the examples, unbatched (2-D) inputs, a batch axis the first step does not prove, padding-free packed rows (the
recurrence would carry one example's state into the next), and subclasses with their own ``forward``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten

from .fallback import Fallback, float_outputs
from .rules import UnsupportedLayerError, Use

__all__ = ["RecurrentFallback", "fallback_for"]

logger = logging.getLogger(__name__)


def fallback_for(module: nn.Module, name: str, param_names: tuple[str, ...], engine=None) -> Fallback:
    """The fallback for a module without a rule: :class:`RecurrentFallback` for recurrent layers, else the generic
    ``torch.func`` one. ``engine`` (the ``ClippingEngine``) lets the recurrent one refuse padding-free packed rows."""
    if isinstance(module, nn.RNNBase):
        return RecurrentFallback(module, name, param_names, engine)
    return Fallback(module, name, param_names)


class _Layout:
    """Where the examples are in one call of a recurrent layer: its batch axis and rows per example (``k > 1``: the
    examples' sequences stacked example-major, proven by the engine's first-step probe)."""

    def __init__(self, axis: int, rows: int):
        self.axis = axis
        self.rows = rows


def _suffix(layer: int, direction: int) -> str:
    """The parameter name suffix of a layer and direction (``weight_ih_l1_reverse``)."""
    return f"_l{layer}{'_reverse' if direction else ''}"


def _cell(mode: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
          w_hr: torch.Tensor | None):
    """One time step of PyTorch's gate equations: ``(h_t, c_t, m_t, r_t)`` (``m_t``: the LSTM's pre-projection
    state; ``r_t``: the GRU's reset gate)."""
    if mode == "LSTM":
        gates = gi + gh
        i, f, _, o = torch.sigmoid(gates).chunk(4, -1)
        c = f * c + i * torch.tanh(gates.chunk(4, -1)[2])
        m = o * torch.tanh(c)
        return (m if w_hr is None else F.linear(m, w_hr)), c, m, None
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None, None, r
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None, None, None


def twin(module: nn.RNNBase, x: torch.Tensor, hx, factors: bool = False, lengths: torch.Tensor | None = None):
    """The layer's forward in plain tensor ops, batch-first ``x`` ``(N, T, d)``, ``hx`` as the module takes it
    (``None``, ``h0`` or ``(h0, c0)``, batch on axis 1). Returns ``(output, h_n[, c_n])`` in the module's layout
    (batch-first output) and, with ``factors``, per parameter suffix the tensors of its uses: ``{"x", "gi", "h_prev",
    "r", "m", "h"}`` (lists indexed by time step for the per-step ones; ``r``: GRU only, ``m``, ``h``: LSTM with
    ``proj_size`` only). ``gi`` (and the projected ``h``) are graph nodes whose gradients give every factor: the
    gradient of ``gh_t = W_hh h_{t-1} + b_hh`` equals that of ``gi_t`` (they are added), except for the GRU's ``n``
    gate, where it is ``r_t ⊙`` it.

    ``lengths`` ``(N,)``: each sequence's own length (a ``PackedSequence``): a step ``t ≥ length`` leaves the state
    unchanged (in both directions, so the reverse direction starts at the sequence's own last step) and outputs 0."""
    mode, hidden = module.mode, module.hidden_size
    proj = getattr(module, "proj_size", 0)
    out_size = proj or hidden
    n, steps = x.shape[0], x.shape[1]
    dirs = 2 if module.bidirectional else 1
    if hx is None:
        h0 = x.new_zeros(module.num_layers * dirs, n, out_size)
        c0 = x.new_zeros(module.num_layers * dirs, n, hidden) if mode == "LSTM" else None
    elif mode == "LSTM":
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    record: dict[str, dict] = {}
    layer_in = x
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            sfx = _suffix(layer, d)
            w_ih = getattr(module, "weight_ih" + sfx).detach()
            w_hh = getattr(module, "weight_hh" + sfx).detach()
            b_ih = getattr(module, "bias_ih" + sfx).detach() if module.bias else None
            b_hh = getattr(module, "bias_hh" + sfx).detach() if module.bias else None
            w_hr = getattr(module, "weight_hr" + sfx).detach() if proj else None
            gi = F.linear(layer_in, w_ih, b_ih)
            if factors and not gi.requires_grad:
                gi.requires_grad_(True)  # a leaf (nothing upstream requires grad): its gradient is still wanted
            gi_steps = gi.unbind(1)
            h, c = h0[layer * dirs + d], (c0[layer * dirs + d] if c0 is not None else None)
            ys: list = [None] * steps
            rec = {"x": layer_in, "gi": gi, "h_prev": [None] * steps, "r": [None] * steps, "m": [None] * steps,
                   "h": [None] * steps if proj else []}
            active = None if lengths is None else (lengths.to(x.device)[:, None] > torch.arange(steps,
                                                                                               device=x.device))
            for t in (range(steps) if d == 0 else reversed(range(steps))):
                new, c_new, m, r = _cell(mode, gi_steps[t], F.linear(h, w_hh, b_hh), h, c, w_hr)
                if factors:
                    rec["h_prev"][t], rec["r"][t], rec["m"][t] = h.detach(), r, m
                    if proj:
                        rec["h"][t] = new
                if active is None:
                    h, c, ys[t] = new, c_new, new
                else:  # past its own length, a sequence keeps its state and outputs 0
                    on = active[:, t:t + 1]
                    h, ys[t] = torch.where(on, new, h), torch.where(on, new, torch.zeros_like(new))
                    c = None if c is None else torch.where(on, c_new, c)
            outs.append(torch.stack(ys, 1))
            h_n.append(h)
            if c is not None:
                c_n.append(c)
            record[sfx] = rec
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, -1)
    result = (layer_in, torch.stack(h_n, 0)) + ((torch.stack(c_n, 0),) if mode == "LSTM" else ())
    return (result, record) if factors else result


class RecurrentFallback(Fallback):
    """Per-example gradients of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (see the module docstring): the engine's
    fallback hook calls :meth:`mapped_leaves`, :meth:`verify` and :meth:`per_example_grads` (which returns ``Use``
    factors, not instantiated gradients)."""

    def __init__(self, module: nn.RNNBase, name: str, param_names: tuple[str, ...], engine=None):
        super().__init__(module, name, param_names)
        self.engine = engine
        cls = type(module).__name__
        if type(module).forward not in (nn.LSTM.forward, nn.GRU.forward, nn.RNN.forward):
            raise UnsupportedLayerError(
                f"{name} ({cls}) is a subclass of a PyTorch recurrent layer with its own forward; hf_dp's recurrent "
                "rule reproduces nn.LSTM / nn.GRU / nn.RNN's own forward only. Freeze its parameters or use a plain "
                "nn.LSTM / nn.GRU / nn.RNN.")
        if module.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
            raise UnsupportedLayerError(f"{name} ({cls}): unknown recurrent mode {module.mode!r}; freeze it.")
        if module.dropout > 0 and module.num_layers > 1:
            raise UnsupportedLayerError(
                f"{name} ({cls}) applies dropout between its layers (dropout={module.dropout}) in train mode, which "
                "DPTrainer trains in; the random mask is drawn inside PyTorch's recurrent kernel, so hf_dp cannot "
                "replay it to compute each example's gradient. Set its dropout to 0 (P-tuning: "
                "PromptEncoderConfig(encoder_dropout=0.0)), freeze it, or use LoRA / P-tuning with "
                "encoder_reparameterization_type='MLP'.")
        logger.info("hf_dp: per-example gradients of %s by back-propagation through time on each micro-batch "
                    "(clipping/recurrent.py).", self.describe())

    def describe(self) -> str:
        numel = sum(getattr(self.module, n).numel() for n in self.param_names)
        return (f"{self.name} ({type(self.module).__name__}: {len(self.param_names)} parameters, {numel} values; "
                "re-run once on the micro-batch in plain tensor ops, one extra forward and backward of the layer; "
                "Linear-style factors, ghost norms where cheaper)")

    # ------------------------------------------------------------------ inputs
    def _inputs(self, args: tuple, kwargs: dict):
        x = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        return x, hx

    @staticmethod
    def probe_layout(big: list, one: list, b: int) -> list[set]:
        """Called by the engine's first-step probe with the input leaves of a call for ``b`` examples and for the
        first alone: per leaf, the axes proven to hold the examples: ``j`` when its size is ``b`` for ``b`` examples
        and 1 for one (other axes may differ: a micro-batch padded to its longest example), and ``"flat"`` for a
        first axis of ``k > 1`` rows per example whose first ``k`` rows for ``b`` examples are the first's alone."""
        proofs = []
        for x2, x1 in zip(big, one):
            axes: set = set()
            if isinstance(x2, torch.Tensor) and isinstance(x1, torch.Tensor) and x2.dim() == x1.dim() and b > 1:
                axes = {j for j in range(x2.dim()) if x2.shape[j] == b and x1.shape[j] == 1}
                k = x1.shape[0] if x1.dim() else 0
                if (k > 1 and x2.shape[0] == b * k and x2.shape[1:] == x1.shape[1:]
                        and torch.allclose(x2[:k].double(), x1.double(), rtol=1e-3, atol=1e-5)):
                    axes.add("flat")
            proofs.append(axes)
        return proofs

    def mapped_leaves(self, args: tuple, kwargs: dict, batch_size: int, known: list | None = None) -> _Layout:
        """The batch axis of the input (``batch_first``) and the rows per example, proven where the engine probed it
        (``known``: :meth:`probe_layout`'s result for this call)."""
        mod, cls = self.module, type(self.module).__name__
        x, _ = self._inputs(args, kwargs)
        if self.engine is not None and getattr(self.engine, "packed", False):
            raise UnsupportedLayerError(
                f"{self.name} ({cls}) runs over padding-free packed rows (several examples in one row): its recurrence "
                "carries one example's state into the next, so no example's gradient is its own. Train without "
                "padding-free packing (packing=False / padding_free=False) or freeze it.")
        if isinstance(x, PackedSequence):
            n = int(x.batch_sizes[0])
            if x.sorted_indices is None and n > 1:
                raise UnsupportedLayerError(
                    f"{self.name} ({cls}) is called with a PackedSequence packed with enforce_sorted=True: its "
                    "sequences are in the order the caller sorted them by length, which hf_dp cannot match to the "
                    "micro-batch's examples. Pack with pack_padded_sequence(..., enforce_sorted=False) on the batch "
                    "in its own order (the packed sequence then restores that order), or freeze it.")
            if n != batch_size:
                raise UnsupportedLayerError(
                    f"{self.name} ({cls}) is called with a PackedSequence of {n} sequences in a micro-batch of "
                    f"{batch_size} examples: its sequences are not the examples, so its gradient cannot be split per "
                    "example. Pack one sequence per example, or freeze it.")
            return _Layout(0, 1)
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedLayerError(
                f"{self.name} ({cls}) is called with an unbatched input ({shape}): one sequence with no batch axis, "
                "so its gradient cannot be split per example. Give it a batch axis holding the examples, or freeze "
                "it.")
        axis = 0 if mod.batch_first else 1
        n = x.shape[axis]
        leaves, _ = tree_flatten((args, kwargs))
        idx = next(i for i, leaf in enumerate(leaves) if leaf is x)
        proof = known[idx] if known is not None and len(known) == len(leaves) else None
        if proof is not None and not isinstance(proof, set):
            raise RuntimeError("hf_dp internal: the engine's first-step probe must call RecurrentFallback.probe_layout "
                               f"for {self.name} (FirstStepChecks.probe_layout).")
        if n == batch_size and (proof is None or axis in proof):  # None: not probed (first micro-batch of one)
            return _Layout(axis, 1)
        if axis == 0 and proof is not None and "flat" in proof and n % batch_size == 0:
            return _Layout(axis, n // batch_size)
        where = "first" if axis == 0 else "second (batch_first=False)"
        raise UnsupportedLayerError(
            f"{self.name} ({cls}): the {where} axis of its input, its batch axis, has size {n} in a micro-batch of "
            f"{batch_size} examples and was not proven to hold the examples (one row per example, or each example's "
            "rows together) when the first step compared the run on all examples with the run on the first alone. "
            "Its batch rows are then not examples (e.g. computed once and shared, or time and batch swapped), so "
            "per-example clipping cannot bound an example's contribution. Freeze it or use LoRA on the other layers.")

    def _run(self, args: tuple, kwargs: dict, layout: _Layout, factors: bool):
        """The twin's ``[output, h_n(, c_n)]`` in the module's own layout (a ``PackedSequence``'s output as its
        ``.data``), and with ``factors`` the record of :func:`twin`."""
        x, hx = self._inputs(args, kwargs)
        packed, lengths = None, None
        if isinstance(x, PackedSequence):
            packed = x
            x, lengths = pad_packed_sequence(PackedSequence(x.data.detach(), x.batch_sizes, x.sorted_indices,
                                                            x.unsorted_indices), batch_first=True)
        elif layout.axis:
            x = x.movedim(layout.axis, 0)
        outs, record = twin(self.module, x, hx, True, lengths) if factors else (twin(self.module, x, hx, False,
                                                                                     lengths), None)
        out = outs[0]
        if packed is not None:  # the packed order: at step t, the first batch_sizes[t] sequences in sorted order
            order = packed.sorted_indices if packed.sorted_indices is not None else torch.arange(out.shape[0])
            order = order.to(out.device)
            out = torch.cat([out[order[:int(n)], t] for t, n in enumerate(packed.batch_sizes)])
        elif layout.axis:
            out = out.movedim(0, layout.axis)
        return [out, *outs[1:]], record

    # ------------------------------------------------------------------ check and gradients
    def verify(self, args: tuple, kwargs: dict, output, batch_size: int, mapped: _Layout) -> None:
        """Refuse unless the twin reproduces the module's real output (``output``, ``h_n``, ``c_n``)."""
        real = float_outputs(output)
        with torch.no_grad():
            mine, _ = self._run(args, kwargs, mapped, factors=False)
        tol = {torch.float64: 1e-6, torch.float32: 1e-4}.get(real[0].dtype, 1e-2)
        if len(real) != len(mine) or any(a.shape != b.shape or not torch.allclose(b.to(a.dtype), a, rtol=tol, atol=tol)
                                         for a, b in zip(real, mine)):
            raise UnsupportedLayerError(
                f"{self.name} ({type(self.module).__name__}): hf_dp's functional twin of this recurrent layer "
                "(PyTorch's gate equations in plain tensor ops) does not reproduce its output on the first "
                "micro-batch, so the per-example gradients it would give are not this layer's. Freeze it or use LoRA "
                "on the other layers.")

    def per_example_grads(self, args: tuple, kwargs: dict, grads: list, outputs_like: list[torch.Tensor],
                          mapped: _Layout, batch_size: int) -> list[Use]:
        """One ``Use`` per trainable parameter: ``G_i = Σ_t ∂L_i/∂(pre-activation)_{i,t}ᵀ (input)_{i,t}``."""
        grads = [torch.zeros_like(o) if g is None else g.to(o.dtype) for g, o in zip(grads, outputs_like)]
        with torch.enable_grad():
            outs, record = self._run(args, kwargs, mapped, factors=True)
            inputs = [t for rec in record.values() for t in [rec["gi"], *rec["h"]]]
            got = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g.detach() for t, g in zip(inputs, got)]
        mod, b, k = self.module, batch_size, 0

        def per_example(t: torch.Tensor) -> torch.Tensor:  # (N, T, f) -> (B, k·T, f): each example's rows together
            return t.detach().reshape(b, -1, t.shape[-1])

        uses = []
        for sfx, rec in record.items():
            d_gi = got[k]
            d_h = torch.stack(got[k + 1:k + 1 + len(rec["h"])], 1) if rec["h"] else None
            k += 1 + len(rec["h"])
            d_gh = d_gi
            if mod.mode == "GRU":  # n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)): the hidden part gets r ⊙ ∂n-pre
                split = 2 * mod.hidden_size
                d_gh = torch.cat([d_gi[..., :split], d_gi[..., split:] * torch.stack(rec["r"], 1).detach()], -1)
            d_gi, d_gh = per_example(d_gi), per_example(d_gh)
            right = {"weight_ih": (d_gi, per_example(rec["x"])), "bias_ih": (None, d_gi),
                     "weight_hh": (d_gh, per_example(torch.stack(rec["h_prev"], 1))), "bias_hh": (None, d_gh)}
            if d_h is not None:
                right["weight_hr"] = (per_example(d_h), per_example(torch.stack(rec["m"], 1).detach()))
            for kind, (left, r) in right.items():
                if kind + sfx in self.param_names:
                    uses.append(Use(getattr(mod, kind + sfx), left, r, 1 if left is None else left.shape[-1],
                                    self.name))
        return uses
