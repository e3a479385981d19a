"""Per-example gradient rules, one file per layer family, in one registry (``registry.py``).

A rule says how a layer type's per-example parameter gradients factor (``base.py``: :class:`Use`, ``G_i = L_iᵀ R_i``;
Li et al. 2022, §4 and App. F); the engine (``engine.py``) decides how to compute norms and clipped sums from the
factors. Rules report every parameter the layer has; the engine keeps the uses of the parameters being trained.

Families, each registering its rules on import: ``linear.py`` (``nn.Linear``, its subclasses, HF ``Conv1D``),
``embedding.py`` (``nn.Embedding`` and subclasses' ``F.embedding`` calls), ``norms.py`` (``nn.LayerNorm``,
elementwise-affine norms verified on the first batch), ``conv.py`` (``nn.Conv1d`` / ``nn.Conv2d``), ``moe.py``
(expert blocks, routers); ``calls.py`` holds the functional-call capture two of them share. Dispatch
(:func:`find_rule`): the user's rules first (:func:`register_layer_rule`), then the built-in ones in
:data:`BUILTIN_ORDER`; first match wins.
"""

from __future__ import annotations

from . import conv, embedding, linear, moe, norms  # noqa: F401 (each registers its rules on import)
from .base import Rule, UnsupportedLayerError, Use
from .registry import (
    BUILTIN_ORDER,
    RegisteredRule,
    find_rule,
    layer_rule_names,
    register_layer_rule,
    rule_parameters,
    unregister_layer_rule,
)

__all__ = ["BUILTIN_ORDER", "RegisteredRule", "Rule", "UnsupportedLayerError", "Use", "find_rule", "layer_rule_names",
           "register_layer_rule", "rule_parameters", "unregister_layer_rule"]
