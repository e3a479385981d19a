"""The package's import structure (issue #16): no import cycle inside hf_dp, and only the trainer's own subclasses
import the trainer. Imports are read with ``ast`` from every module's source, *including* imports inside functions
and under ``if TYPE_CHECKING:`` (a cycle hidden there is still a cycle in the design), relative imports resolved.
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

import hf_dp

ROOT = os.path.dirname(os.path.abspath(hf_dp.__file__))
TRAINER = "hf_dp.trainer"
CARDS = "hf_dp.cards"
#: who may import the trainer: the package's public namespace and the trainer's subclass (trl's SFTTrainer)
TRAINER_IMPORTERS = {"hf_dp", "hf_dp.sft", "hf_dp.preference"}  # preference: DPDPOTrainer, DPRewardTrainer


def module_files(root: str, package: str) -> dict[str, tuple[str, bool]]:
    """``{dotted module name: (path, is_package)}`` of every ``.py`` file under ``root``."""
    out = {}
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [package] + ([] if rel == "." else rel.split(os.sep))
        for f in files:
            if not f.endswith(".py"):
                continue
            if f == "__init__.py":
                out[".".join(parts)] = (os.path.join(dirpath, f), True)
            else:
                out[".".join([*parts, f[:-3]])] = (os.path.join(dirpath, f), False)
    return out


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import statement anywhere in the file counted.

    ``from X import name`` is an edge to ``X.name`` when that is a module of the package, else to ``X``.
    """
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, (path, is_pkg) in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]  # the package relative imports start from
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                    source = ".".join(base)
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for t in targets:
                # `import hf_dp.x.y` names a module; keep the longest prefix that is one of the package's modules
                parts = t.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != mod:
                    graph[mod].add(".".join(parts))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def importers_of(graph: dict[str, set[str]], target: str) -> set[str]:
    return {m for m, deps in graph.items() if target in deps}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "hf_dp")


# ---------------------------------------------------------------------- the reader itself
def test_graph_counts_function_local_and_type_checking_imports(tmp_path):
    """The graph sees every kind of import that can hide a cycle, so the assertions below fail if one is re-added."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "b.py": "def f():\n    from . import c\n    return c\n",
        "c.py": "import pkg.sub.d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..a import A\nfrom .. import e\n",
        "e.py": "x = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    g = import_graph(str(pkg), "pkg")
    assert g["pkg"] == {"pkg.a"}
    assert g["pkg.a"] == {"pkg.b"}  # under TYPE_CHECKING
    assert g["pkg.b"] == {"pkg.c"}  # function-local, `from . import c` resolved to the module
    assert g["pkg.c"] == {"pkg.sub.d"}  # absolute
    assert g["pkg.sub.d"] == {"pkg.a", "pkg.e"}  # two levels up
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    assert importers_of(g, "pkg.a") == {"pkg", "pkg.sub.d"}


def test_graph_reads_every_module(graph):
    assert {"hf_dp", TRAINER, CARDS, "hf_dp.sft", "hf_dp.guarantee", "hf_dp.clipping.fsdp", "hf_dp.clipping.engine",
            "hf_dp.audit.callbacks"} <= set(graph)
    assert {"hf_dp.clipping.engine", "hf_dp.guarantee", CARDS} <= graph[TRAINER]


# ---------------------------------------------------------------------- hf_dp's structure
def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_clipping_does_not_import_the_trainer(graph):
    offenders = {m for m in importers_of(graph, TRAINER) if m.startswith("hf_dp.clipping")}
    assert offenders == set(), "the DP step strategies receive their pieces, never the trainer"


def test_cards_do_not_import_the_trainer(graph):
    assert TRAINER not in graph[CARDS]


def test_only_the_package_and_trainer_subclasses_import_the_trainer(graph):
    assert importers_of(graph, TRAINER) <= TRAINER_IMPORTERS

