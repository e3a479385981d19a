"""Compatibility module: the layer rules moved to ``hf_dp/clipping/rules/`` (one file per layer family, in a
registry with user rules first: :func:`hf_dp.register_layer_rule`). The names other code imports from here are
re-exported unchanged."""

from __future__ import annotations

from .rules import Rule, UnsupportedLayerError, Use, find_rule, rule_parameters

__all__ = ["Rule", "Use", "find_rule", "UnsupportedLayerError", "rule_parameters"]
