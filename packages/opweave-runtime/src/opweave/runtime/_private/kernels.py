"""Which kernels an operator runs, chosen where the operator is built.

The operator factory (:func:`~.graph.operator_from`) asks a stage's :class:`KernelSet` for the
class to build each operator as: the runtime's own (its torch code) or a kernel-backed subclass
a backend offers for this device and dtype, built from the checkpoint like any operator; after
building, the backend may prepack the operator's weights for its GEMM or give it its norm kernel
(:meth:`KernelBackend.finish`). Nothing is swapped into an operator after the fact.

Backends are registered by name, device type and dtype (:func:`register_kernels`), and loaded
on first use from the module that implements them, so the runtime's core never imports them:
vLLM's CPU kernels (``--kernels vllm`` / ``vllm-all``) are one registration below; its CUDA
kernels would be another.

Quantised weights have a registry of their own, keyed by weight format and device type
(:func:`.quant.register_weight_kernel`): what a quantised checkpoint tensor becomes when an operator
loads it. The runtime registers dequantise-then-matmul for every format it reads (the weight is
dequantised to the compute dtype once, at load); a device with native FP8/FP4 GEMMs registers
its own kernel for the formats it runs, and a later registration for a format and device wins.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import OpWeaveRuntimeError
from .options import Kernels

if TYPE_CHECKING:
    from opweave.costmodel import ModelSpec

    from .ops import OpContext, Operator


class KernelBackend(Protocol):
    """What a registered backend provides (see :mod:`opweave.runtime.vllm._kernels`)."""

    def available(self) -> str | None:
        """Why the kernels do not load in this process (None: they do)."""
        ...

    def operator_class(
        self,
        base: type[Operator],
        model: ModelSpec,
        ctx: OpContext,
        layer: int | None,
        kernels: KernelSet,
    ) -> type[Operator] | None:
        """A kernel-backed subclass of ``base`` for this operator, or None (the runtime's)."""
        ...

    def finish(self, op: Operator, kernels: KernelSet) -> list[str]:
        """After ``op`` is built: prepack its weights, give it kernel norms; what switched."""
        ...


@dataclass(frozen=True)
class _Registration:
    name: str
    device: str
    dtypes: frozenset[torch.dtype]
    provider: str  # "module:attribute" of the backend object


_REGISTRY: list[_Registration] = []
_LOADED: dict[str, KernelBackend] = {}


def register_kernels(
    name: str, *, device: str, dtypes: Iterable[torch.dtype], provider: str
) -> None:
    """Offer backend ``name`` (a ``--kernels`` choice) for operators on ``device`` (a device
    type) computing in ``dtypes``; ``provider`` (``"module:attribute"``) is imported when a
    run first asks for it."""
    _REGISTRY.append(_Registration(name, device, frozenset(dtypes), provider))


def backend_for(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend | None:
    """The backend registered as ``name`` for ``device`` and ``dtype``, or None."""
    for reg in _REGISTRY:
        if reg.name == name and reg.device == device.type and dtype in reg.dtypes:
            backend = _LOADED.get(reg.provider)
            if backend is None:
                module, attr = reg.provider.split(":")
                backend = _LOADED[reg.provider] = getattr(importlib.import_module(module), attr)
            return backend
    return None


@dataclass
class KernelSet:
    """The kernels of one stage's operators: the ``--kernels`` choice and what it applies to.

    ``exact``: only kernels whose results differ from the runtime's by summation order (float32);
    ``gemms_only``: only prepacked GEMMs (what a static decode step can trace). ``shared`` is
    the stage's scratch space for a backend (e.g. one block table for every paged layer);
    ``switched`` lists what was built kernel-backed, ``"<layer>.<operator>[.<part>]:<kernel>"``.
    """

    choice: Kernels = Kernels.OPWEAVE
    gemms_only: bool = False
    shared: dict[Any, Any] = field(default_factory=dict)
    switched: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.choice is not Kernels.VLLM_ALL

    def backend(self, device: torch.device, dtype: torch.dtype) -> KernelBackend | None:
        if self.choice is Kernels.OPWEAVE:
            return None
        return backend_for("vllm", device, dtype)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse a choice whose kernels do not load here (before anything is built)."""
        backend = self.backend(device, dtype)
        if backend is None:
            return
        why = backend.available()
        if why is not None:
            raise OpWeaveRuntimeError(f"--kernels {self.choice}: {why}")

    def operator_class(
        self, base: type[Operator], model: object, ctx: OpContext, layer: int | None
    ) -> type[Operator]:
        backend = self.backend(ctx.device, ctx.dtype)
        if backend is None or backend.available() is not None:
            return base
        return backend.operator_class(base, model, ctx, layer, self) or base  # type: ignore[arg-type]

    def finish(self, op: Operator) -> None:
        backend = self.backend(op.device, op.dtype)
        if backend is not None and backend.available() is None:
            self.switched += backend.finish(op, self)


# vLLM's CPU kernels: float32 (exact) and bfloat16 (``vllm-all``), see opweave.runtime.vllm
register_kernels(
    "vllm",
    device="cpu",
    dtypes=(torch.float32, torch.bfloat16),
    provider="opweave.runtime.vllm._kernels:CPU_KERNELS",
)
