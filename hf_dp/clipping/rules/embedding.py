"""The embedding family: ``nn.Embedding`` (``G_W = onehot(ids)ᵀ g``) and its subclasses with their own ``forward``,
whose ``F.embedding`` calls (or row lookups written as indexing) get the same rule (:class:`EmbeddingCalls`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Rule, UnsupportedLayerError, Use, as_btd
from .calls import WeightCalls
from .registry import own_forward, register_builtin

__all__ = ["EmbeddingCalls"]


def _embedding(module: nn.Embedding, name: str, inp: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[Use]:
    """``y_t = W[ids_t]``: ``G_W = onehot(ids)ᵀ g``; the ``padding_idx`` row gets no gradient."""
    ids = inp.reshape(inp.shape[0], -1) if inp.dim() > 1 else inp.reshape(1, -1)
    g = as_btd(grad, module.embedding_dim)
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


class EmbeddingCalls(WeightCalls):
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


_EMBEDDING = Rule("embedding", _embedding, ("weight",), check=_check_embedding)
_EMBEDDING_CALLS = Rule("embedding_calls", _embedding, ("weight",), check=_check_embedding, capture=EmbeddingCalls)

_is_plain_embedding = own_forward(nn.Embedding)
register_builtin("embedding", lambda m: _EMBEDDING if _is_plain_embedding(m) else None)
register_builtin("embedding_calls", lambda m: _EMBEDDING_CALLS if isinstance(m, nn.Embedding) else None)
