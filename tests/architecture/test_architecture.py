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
    assert {"hf_dp.clipping.engine", "hf_dp.guarantee", "hf_dp.release"} <= graph[TRAINER]
    assert CARDS in graph["hf_dp.release"]  # cards and Hub pushes sit beside the record, not in the trainer


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



# ---------------------------------------------------------------------- private names and room sizes (issue #23)
#: Underscore attributes of other libraries' objects that hf_dp must read, each with its reason. Nothing of hf_dp's own
#: belongs here: a name hf_dp defines is made public where another module needs it.
THIRD_PARTY_PRIVATE = {
    "_parameters": "torch nn.Module's parameter registry: a stand-in swapped in where a parameter is registered "
                   "(hooks-vs-autograd check, shared points, LoRA/MoE clones); no public setter keeps the module",
    "_buffers": "torch nn.Module's buffer registry: the buffers a checkpoint saves (released-state guard)",
    "_non_persistent_buffers_set": "torch nn.Module: which buffers state_dict leaves out",
    "_version": "torch tensor version counter: detects an in-place write (buffers, released gradients, Gram cache)",
    "_base": "torch view's base tensor: the tensor a gradient hook survives an in-place op on (recorder)",
    "_DropoutNd": "torch base class of the dropout modules (isinstance)",
    "_BatchNorm": "torch base class of the BatchNorms (isinstance: refused, they mix examples)",
    "_InstanceNorm": "torch base class of the InstanceNorms (isinstance)",
    "_NormBase": "torch base class of the batch/instance norms (isinstance)",
    "_ConvNd": "torch base class of the convolutions (isinstance)",
    "_reversed_padding_repeated_twice": "torch Conv's padding as F.pad takes it (padding_mode != 'zeros')",
    "_apply_gate": "transformers' MoE experts: whether the gate is applied inside the experts (its rule's form)",
    "_prepare_inputs": "transformers Trainer's input preparation (device placement, context parallel); the DP step "
                       "calls the trainer's own, so a subclass's override applies",
    "_replace": "namedtuple's public copy-with-changes method (underscored by design)",
    "_backward_hooks": "torch leaf tensor's Tensor.register_hook hooks: a trainable parameter's gradient hook cannot "
                       "act per example (refused, guarantee.check_no_gradient_hooks); no public way to list them",
    "_post_accumulate_grad_hooks": "torch leaf tensor's register_post_accumulate_grad_hook hooks (the same check)",
}
#: (module, attribute) reads of another hf_dp module's private names still to be made public, each with its reason
KNOWN_PRIVATE_READS: dict[tuple[str, str], str] = {}
#: classes allowed over the limit until their split lands (a ratchet: they may shrink, never grow)
LARGE_CLASSES: dict[str, tuple[int, str]] = {}
MAX_CLASS_LINES = 800
MAX_ENGINE_LINES = 500


def private_reads(source: str, module: str) -> list[str]:
    """``X._name`` reads (and ``from hf_dp... import _name``) where ``X`` is not ``self``, ``cls`` or ``super()``.

    A name the module defines itself (a def, a class, an assignment to ``something._name``) is module-private and may
    be read from any object of that module (a callback reading its own trainer's state). Dunder names are public."""
    tree = ast.parse(source)
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "hf_dp"):
            out += [f"{module}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.endswith("__") and (module, a.name) not in
                    KNOWN_PRIVATE_READS]
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_")):
            continue
        name, owner = node.attr, node.value
        if name.endswith("__") or name in defined or name in THIRD_PARTY_PRIVATE or (module, name) in \
                KNOWN_PRIVATE_READS:
            continue
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        out.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_private_reads_finder_flags_what_it_should():
    """The finder itself: it flags another object's private attribute and an imported private name, and lets pass
    self/cls/super(), dunders, module-private names and the third-party allowlist."""
    src = textwrap.dedent("""
        from .other import _helper
        class A:
            def f(self, engine, t):
                self._mine = 1
                return (engine._plan, self._mine, super()._x, engine.__dict__, engine._mine, t._version,
                        engine.public)
    """)
    assert private_reads(src, "m") == ["m:2: import _helper", "m:6: engine._plan"]


def test_no_module_reads_another_modules_private_names():
    """Nothing under hf_dp/ reads another module's (or another object's) underscore names (DESIGN: rules of the
    house); the clipping engine's callers use its public methods (issue #23)."""
    found = []
    for mod, (path, _) in sorted(module_files(ROOT, "hf_dp").items()):
        with open(path, encoding="utf-8") as f:
            found += private_reads(f.read(), mod)
    assert found == [], "private names read from outside their module:\n  " + "\n  ".join(found)


def class_sizes(source: str, module: str) -> dict[str, int]:
    return {f"{module}.{n.name}": n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ClassDef)}


def test_no_class_over_800_lines_and_the_engine_facade_small():
    """No class in hf_dp/ over 800 lines (those in LARGE_CLASSES: not over their recorded size); clipping/engine.py,
    the façade over the clipping rooms, at most 500 lines."""
    over = []
    for mod, (path, _) in sorted(module_files(ROOT, "hf_dp").items()):
        with open(path, encoding="utf-8") as f:
            for cls, n in class_sizes(f.read(), mod).items():
                if n > LARGE_CLASSES.get(cls, (MAX_CLASS_LINES, ""))[0]:
                    over.append(f"{cls}: {n} lines")
    assert over == [], "classes over the limit: " + ", ".join(over)
    with open(os.path.join(ROOT, "clipping", "engine.py"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= MAX_ENGINE_LINES, f"clipping/engine.py has {n} lines: move the work into a room, keep the façade"
