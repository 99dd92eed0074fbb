"""The packages meet only through each other's public modules.

A package's internals live in ``_private`` modules; another package that imported one would break
whenever those change. This walks every package's source and fails on any import (or dotted
reference) of another package's ``_private`` module; tests and tools are free to look inside.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted((ROOT / "packages").glob("opweave-*/src/opweave/*"))
PRIVATE = re.compile(r"opweave\.(\w+)\.(?:\w+\.)*_\w+")


def _references(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_no_package_imports_another_packages_private_modules() -> None:
    assert {p.name for p in PACKAGES} == {"cli", "costmodel", "planner", "profiler", "runtime"}
    offences = []
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            for line, module in _references(path):
                match = PRIVATE.match(module)
                if match and match.group(1) != package.name:
                    offences.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offences, "\n".join(offences)


def test_the_check_sees_an_offence(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from opweave.runtime._private.cluster import Cluster\n")
    ((_line, module),) = _references(bad)
    assert PRIVATE.match(module).group(1) == "runtime"
