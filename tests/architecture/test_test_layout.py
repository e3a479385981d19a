"""The test suite's own layout (issue #23): tests by feature, one shared testing module, an oracle that cannot call
the code it checks.

* Every test file sits in a feature folder (``tests/<feature>/test_*.py``, the map in ``tests/README.md``), and
  basenames are unique across folders (pytest's default import mode imports each as a top-level module).
* No test module (nor a ``tests/scripts`` worker) imports another test module: what tests share lives in
  ``tests/helpers/``.
* ``tests/helpers/oracle.py`` imports nothing from hf_dp, directly or through the helper modules it imports.

Imports are read with ``ast``, including imports inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers"


def feature_test_files(root: Path = TESTS) -> list[Path]:
    return sorted(p for p in root.rglob("test_*.py") if "helpers" not in p.relative_to(root).parts)


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (``.x`` for a relative import of ``x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out |= {"." + (node.module or a.name) for a in node.names}
            else:
                out.add(node.module or "")
    return out


def test_every_test_file_is_in_a_feature_folder_with_a_unique_basename():
    files = feature_test_files()
    assert files, TESTS
    top = [p.name for p in files if p.parent == TESTS]
    assert not top, (f"test files directly in tests/: {top}; put each in the folder of the feature it tests "
                     "(tests/README.md has the map)")
    seen: dict[str, Path] = {}
    for p in files:
        assert p.name not in seen, (f"two test files named {p.name} ({seen[p.name].relative_to(TESTS)}, "
                                    f"{p.relative_to(TESTS)}): pytest imports both as the module {p.stem}; rename one")
        seen[p.name] = p


def test_no_test_module_imports_another():
    for p in [*feature_test_files(), *sorted((TESTS / "scripts").glob("*.py"))]:
        others = {m for m in imported_modules(p) if m.split(".")[0].startswith("test_")}
        assert not others, (f"{p.relative_to(TESTS)} imports the test module(s) {sorted(others)}; move what they "
                            "share to tests/helpers/ and import it from there")


def test_the_oracle_never_imports_hf_dp():
    seen: set[str] = set()
    todo = ["oracle"]
    while todo:  # oracle.py and every helper module it imports, transitively
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        modules = imported_modules(HELPERS / f"{name}.py")
        hf_dp = sorted(m for m in modules if m.split(".")[0] == "hf_dp")
        assert not hf_dp, f"tests/helpers/{name}.py (the oracle or what it imports) imports {hf_dp}: the oracle " \
                          "must not call hf_dp"
        todo += [m.lstrip(".").split(".")[0] for m in modules if m.startswith(".")]
        todo += [m.split(".")[1] for m in modules if m.startswith("helpers.") and m.count(".") >= 1]
    assert "oracle" in seen
