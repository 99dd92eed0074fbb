"""Packaging contracts: install isolation, checked-in schemas, namespace layout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_checked_in_schemas_match_the_code() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/export_schemas.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_namespace_packages_have_no_top_level_init() -> None:
    for pkg in (ROOT / "packages").iterdir():
        if (pkg / "pyproject.toml").is_file():
            assert not (pkg / "src/opweave/__init__.py").exists(), pkg.name
            assert (pkg / "README.md").is_file(), pkg.name


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv to build a clean venv")
def test_costmodel_installs_without_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = venv / "bin/python"
    subprocess.run(
        ["uv", "pip", "install", "-q", "-p", str(python), str(ROOT / "packages/opweave-costmodel")],
        check=True,
    )
    proc = subprocess.run(
        [str(python), str(ROOT / "tools/check_isolation.py"), "opweave-costmodel"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "none of" in proc.stdout


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv to build wheels and a venv")
def test_planner_cli_extra_gives_the_command_without_torch(tmp_path: Path) -> None:
    """`pip install "opweave-planner[cli]"`, as the README tells planning users: the library and
    the `opweave` command, no torch; the command plans."""
    dist = tmp_path / "dist"
    subprocess.run(
        ["uv", "build", "-q", "--all-packages", "--wheel", "-o", str(dist)], cwd=ROOT, check=True
    )
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    python = venv / "bin/python"
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "-p",
            str(python),
            "--find-links",
            str(dist),
            "opweave-planner[cli]",
        ],
        check=True,
    )
    proc = subprocess.run(
        [str(python), str(ROOT / "tools/check_isolation.py"), "opweave-planner[cli]"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    command = [
        "plan",
        "qwen3-32b",
        "--gpus",
        "a100",
        "--context",
        "8K",
        "--tpot-slo-ms",
        "50",
        "--json",
    ]
    proc = subprocess.run(
        [str(venv / "bin/opweave"), *command],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best"]["strategy"] == "colocated"
