"""How a run is configured: one frozen :class:`RunOptions`, built once and carried to every rank.

The CLI (``opweave run``), the vLLM executor (from ``additional_config``) and the library calls
(:func:`~opweave.runtime.run_plan`, :class:`~opweave.runtime.Cluster`,
:class:`~opweave.runtime.LocalModel`) each build one ``RunOptions`` where the run starts; it
travels unchanged in every rank's spec, so every rank of a run makes the same choices, and this
is the only place a choice (a decode step, a kernel set, how a rank waits) is parsed. No
environment variable changes what a rank runs.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from opweave.costmodel.errors import validation_message

from ..errors import OpWeaveRuntimeError


class DecodeStep(StrEnum):
    """How a rank runs decode steps (``opweave run --decode-step``)."""

    PER_REQUEST = "per-request"  # the operators' per-request form, launched one by one
    STATIC = "static"  # a static-shape step per segment, run operator by operator
    COMPILED = "compiled"  # the static step compiled by inductor (one native program)
    TRACED = "traced"  # traced as one graph but run operator by operator (checks the trace)

    @property
    def static(self) -> bool:
        """Whether decode steps have static shapes (rows laid out at the warm-up)."""
        return self is not DecodeStep.PER_REQUEST

    @property
    def compiler(self) -> str | None:
        """The torch.compile backend of the static step (None: eager)."""
        return {DecodeStep.COMPILED: "inductor", DecodeStep.TRACED: "aot_eager"}.get(self)


class Kernels(StrEnum):
    """Which kernels operators run (``--kernels``)."""

    OPWEAVE = "opweave"  # the runtime's own torch operators
    VLLM = "vllm"  # vLLM's kernels where they keep the runtime's numerics (float32)
    VLLM_ALL = "vllm-all"  # vLLM's kernels wherever they apply (vLLM's rounding)


class Wait(StrEnum):
    """How a CPU rank waits for its peers: busy-polling for up to a second of every wait
    (``spin``) or blocked in the kernel (``block``); ``auto``: spin on a core of its own."""

    AUTO = "auto"
    SPIN = "spin"
    BLOCK = "block"


class FaultInjection(BaseModel):
    """A test seam: rank ``rank`` exits, is killed or hangs at the start of iteration
    ``iteration`` (a prefill pool's rank: of its prefill number ``iteration``). Set only by
    tests (``RunOptions(fault=...)``); a rank installs it as a hook of its loop, which runs
    nothing otherwise."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0)
    iteration: int = Field(ge=0)
    mode: Annotated[str, Field(pattern="^(exit|kill|hang)$")]


Hook = Callable[[int], None]  # called with the iteration (or prefill) about to start


def fault_hook(fault: FaultInjection) -> Hook:
    """The test seam of :attr:`RunOptions.fault`: at iteration ``fault.iteration`` this rank
    exits, is killed, or hangs."""

    def hook(iteration: int) -> None:
        if iteration != fault.iteration:
            return
        if fault.mode == "exit":
            os._exit(1)
        if fault.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)

    return hook


def resolve_device_name(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise OpWeaveRuntimeError(f"device must be cpu, cuda or auto, got {device!r}")
    return device


DTYPES = ("bfloat16", "float16", "float32")


class RunOptions(BaseModel):
    """Everything a run is configured with, the same on every rank.

    >>> RunOptions(decode_step="compiled", device="cpu").decode_step.compiler
    'inductor'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(
        default="auto", description="cpu or cuda; auto (resolved when built): cuda if visible."
    )
    dtype: str | None = Field(
        default=None,
        description="The compute dtype (bfloat16, float16, float32); None: the config's.",
    )
    timeout_s: float = Field(
        default=60.0, gt=0, description="Longest wait of a rank for a peer within an iteration."
    )
    join_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for every rank to join, load and warm up."
    )
    kernels: Kernels = Kernels.OPWEAVE
    decode_step: DecodeStep = DecodeStep.PER_REQUEST
    rank_programs: bool = Field(
        default=True,
        description="CPU ranks whose decode steps trace run each decode iteration as one rank "
        "program (False: the compiled steps run one by one, from Python).",
    )
    threads: int = Field(default=1, ge=1, description="torch threads per rank.")
    wait: Wait = Field(
        default=Wait.AUTO,
        description="How CPU ranks wait for peers (opweave run --wait): auto spins on a core "
        "of a rank's own and blocks where ranks share cores.",
    )
    log_dir: str | None = Field(
        default=None,
        description="A folder the ranks write their logs to (rank<N>.log), kept after the run "
        "and named in a failure's message (opweave run --log-dir); None: the run's temporary "
        "folder, removed with it.",
    )
    fault: FaultInjection | None = Field(
        default=None, description="Test seam: a rank that fails on purpose (tests only)."
    )
    test_torch_p2p: bool = Field(
        default=False,
        description="Test seam: CPU ranks move activations through torch.distributed "
        "point-to-point (gloo), the path CUDA ranks take with NCCL, so that it is tested "
        "without a GPU (tests only).",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return resolve_device_name(value)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
        return name

    @field_validator("timeout_s", "join_timeout_s")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds")
        return value

    @property
    def programs(self) -> bool:
        """Whether ranks run each decode iteration as one rank program (:mod:`.program`): CPU
        ranks whose decode steps trace, unless switched off."""
        return self.device == "cpu" and self.decode_step.compiler is not None and self.rank_programs

    def native(self, world_size: int) -> bool:
        """Whether a run of ``world_size`` ranks needs the native extension: its CPU ranks
        talk over the native wire, and run their rank programs with it."""
        cpu_wire = world_size > 1 and not self.test_torch_p2p
        return self.device == "cpu" and (cpu_wire or self.programs)

    def spin_s(self, own_core: bool) -> float:
        """Seconds of every wait a CPU rank busy-polls before it blocks."""
        if self.wait is Wait.AUTO:
            return SPIN_S if own_core else 0.0
        return SPIN_S if self.wait is Wait.SPIN else 0.0


SPIN_S = 1.0  # a spinning rank blocks once one wait has lasted this long


def options_error(exc: Exception, names: dict[str, str]) -> str:
    """A one-line message for a :class:`RunOptions` validation error, naming the field by the
    caller's name for it (``names``: field -> flag or key)."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else ""
    name = names.get(field, field)
    choices = _CHOICES.get(field)
    if choices is not None:
        return f"{name} must be one of {', '.join(choices)}, not {err.get('input')!r}"
    return f"{name}: {validation_message(err)}"


_CHOICES = {"decode_step": DecodeStep, "kernels": Kernels, "wait": Wait}
