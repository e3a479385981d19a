"""Rules that factor functional calls made inside a module's forward (``Rule.capture``): :class:`WeightCalls`, a
``TorchFunctionMode`` active during the module's forward that hands each ``F.linear`` / ``F.embedding`` call on the
module's weight to the engine's hook, and refuses any other use of the weight. Its subclasses live with their
families (``embedding.py``: ``EmbeddingCalls``; ``moe.py``: ``RouterCalls``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .base import Attach, UnsupportedLayerError

__all__ = ["WeightCalls"]


class WeightCalls(TorchFunctionMode):
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
