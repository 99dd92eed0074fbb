"""Quantised weights in a checkpoint: how each format is stored, sliced and dequantised.

Which linears a checkpoint quantises, and in which format, is the cost model's reading of its
``quantization_config`` (:class:`opweave.costmodel.Precision`); this module reads what is stored
for one such tensor, only a tensor-parallel rank's slice of it, with the matching slice of its
scales, and hands it to the weight kernel registered for its format and device
(:func:`.kernels.weight_kernel_for`). The kernel the runtime registers dequantises to the
compute dtype at load and the operator multiplies with ``F.linear`` (dequantise, then matmul):
exactly the weights a reference computes with after dequantising the same checkpoint. A device
with native kernels registers its own for a format.

Storage conventions (what engines read):

- ``fp8-block`` (DeepSeek-V3, Qwen3-FP8, MiniMax-M2 FP8): ``<w>`` float8_e4m3fn ``[.., R, C]`` and
  ``<w>_scale_inv`` float32 ``[.., ceil(R/br), ceil(C/bc)]``; value = fp8 x scale of its block
  (DeepSeek-V3's ``weight_dequant``, vLLM's ``Fp8LinearMethod`` with ``weight_block_size``).
- ``fp8`` (per-tensor or per-channel): ``<w>`` float8_e4m3fn and ``<w>_scale`` float32 of one
  element, or one per output row (vLLM ``Fp8LinearMethod``, ModelOpt FP8).
- ``mxfp4`` (OCP Microscaling, gpt-oss): ``<w>_blocks`` uint8 ``[.., R, C/32, 16]`` (two E2M1
  values a byte, low nibble first) and ``<w>_scales`` uint8 ``[.., R, C/32]`` (E8M0: 2^(s-127)).
- ``nvfp4`` (ModelOpt): ``<w>`` uint8 ``[R, C/2]`` (E2M1 pairs, low nibble first),
  ``<w>_scale`` float8_e4m3fn ``[R, C/16]`` and ``<w>_scale_2`` float32 (one per tensor);
  value = e2m1 x scale x scale_2.

A scale covers a block of the matrix, so a tensor-parallel slice must hold whole blocks: a slice
that would cut one is refused, naming the tensor (vLLM refuses the same plan, see
``validate_block_quant_shapes``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import CheckpointError, ShardingError

Ranges = Sequence[tuple[int, int]]
# the values an E2M1 nibble encodes (OCP Microscaling Formats v1.0, table 5; sign in bit 3)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
MX_BLOCK = 32  # values per E8M0 scale (OCP MX: k = 32)


@dataclass(frozen=True)
class StoredFormat:
    """How a quantised tensor named ``<w>`` is stored: the tensor holding its values, the
    tensors holding its scales, and the block each scale covers along the last two dims."""

    format: str  # the cost model's weight-format name (fp8, fp8-block, mxfp4, nvfp4)
    values: str  # suffix of the values tensor ("" for the name itself)
    scales: tuple[str, ...]  # suffixes of the scale tensors, sliced with the values
    tensor_scales: tuple[str, ...] = ()  # suffixes of per-tensor scales (read whole)


FORMATS = {
    "fp8-block": StoredFormat("fp8-block", "", ("_scale_inv",)),
    "fp8": StoredFormat("fp8", "", ("_scale",)),
    "mxfp4": StoredFormat("mxfp4", "_blocks", ("_scales",)),
    "nvfp4": StoredFormat("nvfp4", "", ("_scale",), ("_scale_2",)),
}

# what a checkpoint holding quantised tensors names the tensors beside them
SCALE_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_scales", "_blocks")


@dataclass(frozen=True)
class QuantisedSlice:
    """One rank's slice of a quantised tensor as stored: ``values`` and ``scales`` (sliced
    alike), ``tensor_scales`` (whole), and the shape it dequantises to."""

    name: str
    format: str
    values: torch.Tensor
    scales: tuple[torch.Tensor, ...]
    tensor_scales: tuple[torch.Tensor, ...]
    block: tuple[int, int]  # rows x columns one scale covers (0: the whole extent)
    shape: tuple[int, ...]


Read = Callable[[str, int, Ranges | None], torch.Tensor]


def block_of(fmt: str, scheme_rows: int | None, scheme_cols: int | None) -> tuple[int, int]:
    """Rows x columns one scale covers (0: the whole extent) for a stored format."""
    if fmt == "mxfp4":
        return (1, MX_BLOCK)
    return (scheme_rows or 0, scheme_cols or 0)


def read_slice(
    name: str,
    fmt: str,
    block: tuple[int, int],
    full_shape: Sequence[int],
    read: Read,
    dim: int,
    ranges: Ranges | None,
) -> QuantisedSlice:
    """Read the values and scales of ``ranges`` along ``dim`` of the dequantised tensor
    ``name`` (shape ``full_shape``); a range that cuts a scale block is a one-line error."""
    stored = FORMATS[fmt]
    ndim = len(full_shape)
    values_name = name + stored.values
    scale_names = [name + s for s in stored.scales]
    br, bc = block
    # per-tensor and per-channel FP8 scales: one element, or one per output row
    if fmt == "fp8":
        br, bc = 0, 0
    value_dim, scale_dim = dim, dim
    value_ranges = scale_ranges = None
    if ranges is not None:
        along = (br, bc)[dim - (ndim - 2)] if dim >= ndim - 2 else 1
        extent = full_shape[dim]
        for lo, hi in ranges:
            if along > 1 and (lo % along or (hi % along and hi != extent)):
                raise ShardingError(
                    f"{name}: a tensor-parallel slice [{lo}, {hi}) of dimension {dim} cuts its "
                    f"{fmt} scale blocks of {along}; choose a tp that gives each rank whole "
                    "blocks, or serve a checkpoint with smaller blocks"
                )
        value_ranges = list(ranges)
        # a scale per block (per value along dims blocks do not span); one for the whole extent
        scale_ranges = (
            [(lo // along, math.ceil(hi / along)) for lo, hi in ranges] if along else None
        )
        if fmt == "nvfp4" and dim == ndim - 1:  # two values a byte
            value_ranges = [(lo // 2, hi // 2) for lo, hi in ranges]
        if fmt == "mxfp4" and dim == ndim - 1:  # columns are stored as [C/32, 16] bytes
            value_ranges = scale_ranges
    values = read(values_name, value_dim, value_ranges)
    scales = []
    for scale_name in scale_names:
        if fmt == "fp8":
            scale = read(scale_name, 0, None)
            per_row = scale.numel() > 1
            if per_row and ranges is not None and dim == ndim - 2:
                scale = scale.reshape(-1)[[i for lo, hi in ranges for i in range(lo, hi)]]
            scales.append(scale.reshape(-1, 1) if per_row else scale.reshape(()))
            continue
        scales.append(read(scale_name, scale_dim, scale_ranges))
    tensor_scales = tuple(read(name + s, 0, None) for s in stored.tensor_scales)
    shape = list(full_shape)
    if ranges is not None:
        shape[dim] = sum(hi - lo for lo, hi in ranges)
    return QuantisedSlice(name, fmt, values, tuple(scales), tensor_scales, (br, bc), tuple(shape))


def missing_scale(name: str, fmt: str, has: Callable[[str], bool]) -> str | None:
    """The first scale tensor of ``name`` the checkpoint lacks (None: all there)."""
    stored = FORMATS[fmt]
    for suffix in (*stored.scales, *stored.tensor_scales):
        if not has(name + suffix):
            return name + suffix
    return None


# -- dequantisation (the runtime's weight kernel) --------------------------------------------
def _expand(scale: torch.Tensor, block: tuple[int, int], shape: Sequence[int]) -> torch.Tensor:
    """A block scale ``[.., ceil(R/br), ceil(C/bc)]`` repeated to ``[.., R, C]``."""
    rows, cols = shape[-2], shape[-1]
    br, bc = block
    scale = scale.float()
    if br:
        scale = scale.repeat_interleave(br, dim=-2)[..., :rows, :]
    if bc:
        scale = scale.repeat_interleave(bc, dim=-1)[..., :cols]
    return scale


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack E2M1 pairs (low nibble first) to float32, doubling the last dimension."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lo = lut[(packed & 0x0F).long()]
    hi = lut[(packed >> 4).long()]
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantise(q: QuantisedSlice) -> torch.Tensor:
    """The float32 values of a quantised slice: the stored value times its scale(s), in that
    order, in float32 (the products a reference dequantiser forms; E2M1 x E8M0 is exact)."""
    if q.format in ("fp8", "fp8-block"):
        values = q.values.float()
        scale = q.scales[0]
        if q.format == "fp8":
            return values * scale.float()
        return values * _expand(scale, q.block, values.shape)
    if q.format == "mxfp4":
        values = _e2m1(q.values)  # [.., R, C/32, 32]
        exponent = q.scales[0].to(torch.int32) - 127
        scale = torch.pow(2.0, exponent.float())
        return (values * scale[..., None]).flatten(-2)
    if q.format == "nvfp4":
        values = _e2m1(q.values)  # [.., R, C]
        group = values.shape[-1] // q.scales[0].shape[-1]
        scale = q.scales[0].float().repeat_interleave(group, dim=-1)
        return values * scale * q.tensor_scales[0].float()
    raise CheckpointError(f"{q.name}: no dequantisation for {q.format} weights")


class Dequantise:
    """The runtime's weight kernel for every quantised format: dequantise at load, to the
    compute dtype (the operator then multiplies with ``F.linear``)."""

    def load(self, q: QuantisedSlice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = dequantise(q)
        if tuple(out.shape) != q.shape:
            raise CheckpointError(
                f"{q.name}: its {q.format} values and scales dequantise to {list(out.shape)}, "
                f"the model config implies {list(q.shape)}; the checkpoint is malformed"
            )
        return out.to(device=device, dtype=dtype)


DEQUANTISE = Dequantise()


# -- the weight-kernel registry ------------------------------------------------------------
class WeightKernel(Protocol):
    """What a quantised weight is loaded as (see :mod:`.quant`)."""

    def load(self, q: QuantisedSlice, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The weight an operator multiplies by, from one rank's slice of the stored tensor."""
        ...


_WEIGHT_KERNELS: dict[tuple[str, str], str] = {}
_WEIGHT_LOADED: dict[str, WeightKernel] = {}


def register_weight_kernel(fmt: str, *, device: str, provider: str) -> None:
    """Load ``fmt`` weights (a cost-model weight format: ``fp8-block``, ``fp8``, ``mxfp4``,
    ``nvfp4``) on ``device`` (a device type) with ``provider`` (``"module:attribute"``, imported
    on first use); replaces an earlier registration for the same format and device."""
    _WEIGHT_KERNELS[(fmt, device)] = provider


def weight_kernel_for(fmt: str, device: torch.device) -> WeightKernel | None:
    """The kernel registered for ``fmt`` weights on ``device``, or None."""
    provider = _WEIGHT_KERNELS.get((fmt, device.type))
    if provider is None:
        return None
    kernel = _WEIGHT_LOADED.get(provider)
    if kernel is None:
        module, attr = provider.split(":")
        kernel = _WEIGHT_LOADED[provider] = getattr(importlib.import_module(module), attr)
    return kernel


def weight_formats() -> tuple[str, ...]:
    """The quantised weight formats some device has a registered kernel for."""
    return tuple(sorted({fmt for fmt, _ in _WEIGHT_KERNELS}))


# Quantised checkpoints: dequantised to the compute dtype at load, then the ordinary GEMM (any
# device torch runs on); native FP8/FP4 GEMMs would register over these
for _fmt in ("fp8-block", "fp8", "mxfp4", "nvfp4"):
    for _device in ("cpu", "cuda"):
        register_weight_kernel(
            _fmt, device=_device, provider="opweave.runtime._private.quant:DEQUANTISE"
        )
