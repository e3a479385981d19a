"""Command-line parsing shared by the example scripts: ``HfArgumentParser`` plus trl-style argument files.

* a single ``.json`` / ``.yaml`` / ``.yml`` argument: every argument comes from that file;
* ``--config FILE`` (YAML or JSON) anywhere among the options: the file's values become the defaults, the other
  options override them; unknown names in the file are an error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from transformers import HfArgumentParser


def _pop_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Remove ``--config PATH`` / ``--config=PATH`` from ``argv``; return the path and the rest."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise SystemExit("--config needs a file path")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _read_config(path: str) -> dict[str, Any]:
    import yaml  # PyYAML comes with `datasets`; YAML is a superset of JSON

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a mapping of argument names to values, got {type(config).__name__}.")
    return config


def parse_args(parser: HfArgumentParser, argv: Sequence[str] | None = None) -> tuple[Any, ...]:
    """Parse ``argv`` (default ``sys.argv[1:]``) into ``parser``'s dataclasses, as transformers' scripts do."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = os.path.abspath(argv[0])
        if path.endswith(".json"):
            return parser.parse_json_file(path)
        return parser.parse_yaml_file(path)
    config_path, argv = _pop_config(argv)
    if config_path is not None:
        config = _read_config(config_path)
        unknown = sorted(set(config) - {action.dest for action in parser._actions})
        if unknown:
            raise ValueError(f"Unknown arguments in {config_path}: {unknown}")
        parser.set_defaults(**config)
    return parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("examples/cli.py is the argument parsing the example scripts import; run one of them instead.")
