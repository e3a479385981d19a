"""Per-example causal-LM losses with the LM head applied in chunks of positions (issue 24, item 3).

A causal LM's forward multiplies every position's hidden state by the LM head, ``(B, T, d) → (B, T, V)``; the loss
then upcasts those logits to float32, keeps the log-softmax for the backward, and the backward makes a gradient of
the same size. With Llama-3-class vocabularies (V = 128 k) these ``B × T × V`` float32 copies are most of a step's
memory. trl's SFT computes its (non-private) loss through a fused head that never forms them
(``trl.trainer.utils.add_fused_lm_head``); hf_dp cannot use that head, because its weight would be used outside the
layer hooks that clip it per example.

Here the head runs as the ordinary, hooked ``nn.Module`` it is, on one chunk of ``chunk_size`` positions at a time,
each chunk inside ``torch.utils.checkpoint`` (non-reentrant): the chunk's logits, their float32 copy and the
log-softmax exist only while that chunk is computed, in the forward and again when the backward recomputes it (Chen
et al. 2016). What the head's per-example clipping needs is unchanged: each chunk is one call of the head, whose
input the engine keeps as a saved tensor of the graph (``clipping/checkpointing.py``: dropped with the chunk,
recomputed with it) and whose output gradient ``(B, chunk, V)`` arrives in the backward. One parameter called once per
chunk has one per-example gradient, the sum over its calls; its ghost norm includes the cross terms between chunks
(``clipping/norms.py``, Li et al. 2022 App. F), so per-example norms and clipped sums are exactly those of the
unchunked head. What remains of size ``B × T × V`` is the head's output gradient the engine holds until the head's
norm is computed — one copy, in the model's dtype, where the unchunked loss held several in float32.

The per-token losses are reduced to per-example losses by the same functions as the model's own per-example loss
(:func:`hf_dp.losses.mean_over_targets`; per packed example in DP-SFT), and before the first update the trainer
checks, on one example, that the chunked loss equals the loss computed from the model's own forward
(:func:`check_against_model`): a model whose forward does more between its backbone and its head than
:func:`lm_parts` reproduces is refused, never trained with another objective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .losses import (
    IGNORE_INDEX,
    PerExampleLoss,
    causal_lm_loss,
    causal_lm_targets,
    labels_to_compare,
    mean_over_targets,
    token_cross_entropy,
)

__all__ = ["ChunkedLMLoss", "lm_parts", "register_token_loss", "token_losses_in_chunks"]

#: per-example loss function -> (targets(labels, **kw), reduce(per_token, targets, **kw)) of its token form
_TOKEN_FORMS: dict[Callable, tuple[Callable, Callable]] = {}


def register_token_loss(loss: PerExampleLoss, targets: Callable, reduce: Callable) -> None:
    """Declare that ``loss(outputs, labels, **kw)`` is ``reduce(token_cross_entropy(outputs.logits, t), t, **kw)``
    with ``t = targets(labels, **kw)``: the form a chunked head can compute without the full logits."""
    _TOKEN_FORMS[loss] = (targets, reduce)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def logit_scaling(base: nn.Module, text: Any) -> tuple[float | None, float | None]:
    """``(multiplier, divisor)``: the constants a causal LM's forward applies to its head's logits before the loss,
    read where the model's own forward reads them: Cohere / Cohere2 multiply by the model's ``logit_scale``
    (``logits * self.logit_scale``), the Granite family divides by ``config.logits_scaling``. ``None``: not applied.
    Anything else between the head and the loss is caught by :meth:`ChunkedLMLoss.check_against_model`."""
    mul = getattr(base, "logit_scale", None)
    div = getattr(text, "logits_scaling", None)
    return (mul if _number(mul) else None), (div if _number(div) and div else None)


def lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None]:
    """``(backbone, head, final_logit_softcapping)`` of a transformers causal LM (under a PEFT LoRA-type adapter
    too), or ``ValueError`` saying why the head cannot be applied apart from the model's forward. The constant
    scaling of the logits (:func:`logit_scaling`) is read by :func:`lm_scaling`."""
    name = type(model).__name__
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError(f"{name} has a prompt-learning adapter: its virtual tokens are prepended by the adapter's own "
                         "forward, which the chunked loss does not run.")
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    prefix = getattr(base, "base_model_prefix", None)
    backbone = getattr(base, prefix, None) if prefix else None
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(backbone, nn.Module) or backbone is base or not isinstance(head, nn.Module):
        raise ValueError(f"{type(base).__name__} has no separate backbone (`{prefix}`) and LM head "
                         "(`get_output_embeddings()`) to run apart.")
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return backbone, head, getattr(text, "final_logit_softcapping", None)


def lm_scaling(model: nn.Module) -> tuple[float | None, float | None]:
    """:func:`logit_scaling` of ``model`` (under a PEFT adapter: of its base model)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    return logit_scaling(base, config.get_text_config() if hasattr(config, "get_text_config") else config)


def token_losses_in_chunks(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk_size: int,
                           softcap: float | None = None,
                           on_output: Callable[[torch.Tensor], None] | None = None,
                           window: Callable[[int, int], Any] | None = None,
                           scaling: tuple[float | None, float | None] = (None, None)) -> torch.Tensor:
    """``(B, T)`` per-token cross-entropy of ``head(hidden)`` against ``targets`` (0 where ignored), computed
    ``chunk_size`` positions at a time, each chunk checkpointed (its logits are not kept for the backward).
    ``scaling``: ``(multiplier, divisor)`` applied to the logits first, as the model's forward does
    (:func:`logit_scaling`), then ``softcap``.
    ``on_output`` is called with each chunk's output (the engine marks the start of the backward there: a chunk
    re-run by the backward is a recompute, ``clipping/checkpointing.py``); ``window(start, stop)``, a context
    manager entered around each call of the head, tells the engine which positions the call sees (packed rows are
    split per packed example over them, ``Recorder.positions``)."""

    def chunk_loss(h: torch.Tensor, t: torch.Tensor, start: int) -> torch.Tensor:
        with window(start, start + h.shape[1]) if window is not None else contextlib.nullcontext():
            logits = head(h)
        mul, div = scaling
        if mul is not None:
            logits = logits * mul
        if div is not None:
            logits = logits / div
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return token_cross_entropy(logits, t)

    parts = []
    for start in range(0, hidden.shape[1], chunk_size):
        h, t = hidden[:, start:start + chunk_size], targets[:, start:start + chunk_size]
        out = checkpoint(chunk_loss, h, t, start, use_reentrant=False) if torch.is_grad_enabled() \
            else chunk_loss(h, t, start)
        if on_output is not None:
            on_output(out)
        parts.append(out)
    return torch.cat(parts, dim=1)


class ChunkedLMLoss:
    """Each example's loss of a causal LM with the head in chunks: ``self(net, model_inputs, labels, loss, **kw)``.

    Args:
        model: the model the trainer trains (a transformers causal LM, possibly under a LoRA-type PEFT adapter).
        chunk_size: positions per chunk.

    Raises ``ValueError`` (with the reason) when the model's head cannot be run apart from its forward; ``loss`` (the
    trainer's per-example loss, read at each call) must have a registered token form (:meth:`check_loss`).
    """

    def __init__(self, model: nn.Module, chunk_size: int, fsdp: bool = False):
        if fsdp:
            raise ValueError("lm_loss_chunk_size is not supported under FSDP: the chunked head calls the backbone and "
                             "the head apart from the root module, whose forward gathers the sharded parameters. Set "
                             "`lm_loss_chunk_size=None`.")
        try:
            lm_parts(model)
        except ValueError as err:
            raise ValueError(f"lm_loss_chunk_size: {err} Set `lm_loss_chunk_size=None`.") from None
        self.chunk_size = int(chunk_size)

    @staticmethod
    def check_loss(loss: PerExampleLoss) -> None:
        """``ValueError`` unless ``loss`` is a loss whose token form the chunked head computes."""
        if loss not in _TOKEN_FORMS:
            raise ValueError(
                f"lm_loss_chunk_size: the per-example loss ({getattr(loss, '__name__', type(loss).__name__)}) is "
                "not the causal-LM next-token loss (DPTrainer's default for causal LMs, DPSFTTrainer's): it is "
                "computed from the full logits, which the chunked head never forms. Set `lm_loss_chunk_size=None`.")

    def __call__(self, net: nn.Module, model_inputs: dict, labels: torch.Tensor, loss: PerExampleLoss,
                 on_output: Callable[[torch.Tensor], None] | None = None,
                 window: Callable[[int, int], Any] | None = None, **kwargs: Any) -> torch.Tensor:
        self.check_loss(loss)
        backbone, head, softcap = lm_parts(net)
        inputs = {k: v for k, v in model_inputs.items() if k not in ("labels", "logits_to_keep")}
        out = backbone(**inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        make_targets, reduce = _TOKEN_FORMS[loss]
        targets = make_targets(labels, **kwargs)
        if targets.shape != hidden.shape[:2]:
            raise ValueError(f"lm_loss_chunk_size: the chunked loss needs one target per position: labels "
                             f"{tuple(labels.shape)}, hidden states {tuple(hidden.shape)}.")
        per_token = token_losses_in_chunks(hidden, head, targets, self.chunk_size, softcap, on_output, window,
                                           scaling=lm_scaling(net))
        return reduce(per_token, targets, **kwargs)

    def check_batch(self, batch: dict, labels: torch.Tensor, longest: int = 1024) -> tuple[dict, torch.Tensor]:
        """The row(s) the first-step check compares on: ``batch`` itself, or its first ``max(longest, 2 · chunk + 1)``
        positions when it is longer (the model's full logits of a long row are what the chunked loss exists to avoid
        holding) — if every per-position tensor can be cut there and some target remains to compare."""
        t = labels.shape[1] if labels.dim() >= 2 else 0
        n = max(longest, 2 * self.chunk_size + 1)
        if t <= n:
            return batch, labels
        cut = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == t:
                if t in v.shape[2:]:  # e.g. a (B, 1, T, T) mask: not cut along one axis only
                    return batch, labels
                cut[k] = v[:, :n]
            elif isinstance(v, torch.Tensor) and t in v.shape[1:]:
                return batch, labels
            else:
                cut[k] = v
        short = labels[:, :n]
        return (cut, short) if bool((short[:, 1:] != -100).any()) else (batch, labels)

    def check_against_model(self, row: dict, labels: torch.Tensor, segment_ids: Callable[[dict], Any],
                            run_model: Callable[..., torch.Tensor], run_chunked: Callable[..., torch.Tensor],
                            half: bool, model: nn.Module) -> None:
        """Before the first update: on a micro-batch's first ``row`` (:meth:`check_batch`; its packed examples by
        ``segment_ids``), the chunked per-example losses (``run_chunked(row, labels, **kw)``) equal those of the
        model's own forward (``run_model``: the trainer's per-example loss of its outputs), to 1e-4 (2e-2 in half
        precision), or ``ValueError`` (nothing has been released). A row with no labelled position (both losses 0: a
        vacuous comparison) is compared on its own tokens (``losses.labels_to_compare``) whatever the trainer's task,
        also with ``per_example_loss=causal_lm_loss`` passed explicitly: every loss with a token form is an LM's."""
        row, labels = self.check_batch(row, labels)
        if not bool((labels != IGNORE_INDEX).any()):
            labels = labels_to_compare("causal_lm", row, labels)
        extra = {} if (seg := segment_ids(row)) is None else {"segments": seg}
        rtol, model_name = (2e-2 if half else 1e-4), type(model).__name__
        with torch.no_grad():
            expected, got = run_model(row, labels, **extra).double(), run_chunked(row, labels, **extra).double()
        if expected.shape != got.shape or not torch.allclose(got, expected, rtol=rtol, atol=rtol):
            raise ValueError(
                f"lm_loss_chunk_size: the loss hf_dp computes from {model_name}'s backbone and LM head in chunks "
                f"({[round(x, 6) for x in got.tolist()]}) differs from the loss of the model's own forward on the "
                f"same examples ({[round(x, 6) for x in expected.tolist()]}): its forward does more between the "
                "backbone and the head (a scale, a cap, another head) than the chunked loss reproduces, so it would "
                "train another objective. Set `lm_loss_chunk_size=None` (the loss is then computed from the model's "
                "full logits).")


register_token_loss(causal_lm_loss, lambda labels: causal_lm_targets(labels), mean_over_targets)
