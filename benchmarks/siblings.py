"""Loading a script of ``benchmarks/`` or ``examples/`` by file: both are folders of scripts, not packages. The one
loader of the benchmarks that build on each other (``utility_unseen.py``, ``utility_proxy.py``, ``utility_compute.py``,
``utility_mpnet.py``); each imports it with ``benchmarks/`` on ``sys.path``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load(name: str, path: Path) -> ModuleType:
    """The module in ``path``, registered as ``name`` and executed once per process: a later call (from another
    benchmark, or a test that loaded it first under the same name) returns the same module object."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def accuracy_by_key(records: list[dict[str, Any]], key: Any) -> dict[str, dict[int, float]]:
    """Test (or validation) accuracy in % by run key (``key(record)``: ``utility.key``) and seed, for the tables and
    the choice rules of the benchmarks built on ``utility.py``."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        out.setdefault(key(r), {})[r["seed"]] = 100 * r["accuracy"]
    return out
