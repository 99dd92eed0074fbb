"""Read individual tensors from a Hugging Face safetensors checkpoint.

A stage of a plan holds a contiguous slice of the operator sequence and must not pay for the rest of
the model, so tensors are read one name at a time, never whole files; a tensor-parallel rank reads
only its own index ranges of a tensor (``safe_open(...).get_slice``), so its bytes read scale with
its shard. Only file headers are parsed to learn which names exist; that tells the name mapping
below which layout the checkpoint uses (text vs multimodal prefix, fused vs per-expert MoE).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from opweave.costmodel import LINEAR_ATTENTION, Architecture, ModelSpec, Precision, WeightScheme

from ..errors import CheckpointError, UnsupportedModelError
from . import quant

_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
Ranges = Sequence[tuple[int, int]]


class TensorSource:
    """Tensors by checkpoint name, as operators fetch them; subclasses say where they come from.

    ``bytes_read`` and ``names_read`` account for every tensor fetched, so callers can show that a
    stage loaded only its own weights. Tensors fetched with ``shared=True`` (a tied embedding, used
    by both ``embed`` and ``lm_head``) are fetched once per dtype and device, and reused until
    :meth:`close`. ``prefix`` is where the decoder's tensors live (``model.``, ...).
    """

    prefix: str

    def __init__(self) -> None:
        self._loaded: dict[tuple[Any, ...], torch.Tensor] = {}
        self.names_read: list[str] = []
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def _fetch(
        self,
        name: str,
        dtype: torch.dtype | None,
        device: torch.device,
        dim: int = 0,
        ranges: Ranges | None = None,
    ) -> torch.Tensor:
        """One tensor (only index ``ranges`` along ``dim``, concatenated, when given) on
        ``device`` in ``dtype`` (``None``: as stored); accounts for the bytes read."""
        raise NotImplementedError

    def _account(self, name: str, tensor: torch.Tensor) -> None:
        self.names_read.append(name)
        self.bytes_read += tensor.numel() * tensor.element_size()

    def get(
        self,
        name: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        shared: bool = False,
        dim: int = 0,
        ranges: Ranges | None = None,
    ) -> torch.Tensor:
        """One tensor by its checkpoint name, on ``device`` in ``dtype``; with ``ranges``, only
        those ``[lo, hi)`` index ranges along ``dim`` (a tensor-parallel shard)."""
        device = torch.device(device)
        key = (name, dtype, str(device), dim, None if ranges is None else tuple(ranges))
        if shared and key in self._loaded:
            return self._loaded[key]
        tensor = self._fetch(name, dtype, device, dim, ranges)
        if shared:
            self._loaded[key] = tensor
        return tensor

    def close(self) -> None:
        """Drop the sharing cache (loaded tensors stay with their operators)."""
        self._loaded.clear()

    def lm_head_name(self) -> str:
        """The output projection's tensor name (tied models: the input embedding's)."""
        raise NotImplementedError

    def moe_module(self, layer: int) -> str:
        """The module prefix of a layer's experts (``mlp.``, ``block_sparse_moe.``)."""
        raise NotImplementedError

    def load_experts(
        self,
        layer: int,
        num_experts: int,
        intermediate: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        channels: tuple[int, int] | None = None,
        experts: tuple[int, int] | None = None,
        in_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert of a layer as ``gate_up [E, 2I, H]`` and ``down [E, H, I]``."""
        raise NotImplementedError

    def model_name(self, suffix: str) -> str:
        """Name of a non-layer tensor, e.g. ``embed_tokens.weight``, under the detected prefix."""
        return f"{self.prefix}{suffix}"

    def layer_name(self, layer: int, suffix: str) -> str:
        return f"{self.prefix}layers.{layer}.{suffix}"


class Checkpoint(TensorSource):
    """Named-tensor access to a model folder (single ``model.safetensors`` or a sharded index).

    A quantised tensor (see :mod:`.quant`) is read with its scales, only the rank's slice of
    both, and loaded by the weight kernel registered for its format and device; ``precision``
    (the model's, from its ``quantization_config``; read from the folder when not given) says
    which modules are quantised, and in which blocks.
    """

    def __init__(self, model_dir: str | Path, precision: Precision | None = None) -> None:
        super().__init__()
        self.model_dir = Path(model_dir)
        self._precision = precision
        self._file_of = self._index()
        self._handles: dict[Path, Any] = {}
        prefix = next(
            (p for p in _MODEL_PREFIXES if f"{p}layers.0.input_layernorm.weight" in self._file_of),
            None,
        )
        if prefix is None:
            raise CheckpointError(
                f"{self.model_dir}: no decoder layers found under {', '.join(_MODEL_PREFIXES)}"
            )
        self.prefix = prefix
        # headers are only consulted for a tensor's storage when something may be quantised
        self._may_be_quantised = (
            precision is None
            or precision.quantized
            or any(n.endswith(quant.SCALE_SUFFIXES) for n in self._file_of)
        )

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and "/" not in f and f.endswith(".safetensors")
                    for f in weight_map.values()
                ):
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                raise CheckpointError(
                    f'{index}: not a safetensors index (a JSON object whose "weight_map" maps '
                    "tensor names to .safetensors files in the folder)"
                ) from None
            return {str(name): self.model_dir / file for name, file in weight_map.items()}
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors files")
        file_of: dict[str, Path] = {}
        for file in files:
            file_of.update(dict.fromkeys(_open(file).keys(), file))
        return file_of

    def has(self, name: str) -> bool:
        return name in self._file_of or name + "_blocks" in self._file_of  # mxfp4: see .quant

    def check_shapes(self, arch: Architecture) -> int:
        """Raise :class:`CheckpointError` naming the first tensor whose stored shape is not the
        one ``arch`` (the folder's config.json) implies; reads file headers only. Names the
        runtime does not read are not checked; missing ones fail when an operator loads.
        Returns how many tensors were checked."""
        checked = 0
        for name, file in self._file_of.items():
            want = expected_shape(arch, self.prefix, name)
            if want is None:
                continue
            try:
                got = self._shape(name)  # packed values: the shape they dequantise to
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{file}: cannot read tensor {name!r}: {exc}") from None
            if got != want and not _stored_in_out(arch, name, got, want):
                raise CheckpointError(
                    f"{self.model_dir}: tensor {name!r} has shape {list(got)}, but config.json "
                    f"implies {list(want)}; the weights and config.json are of different models"
                )
            checked += 1
        moe = arch.moe
        if moe is not None and moe.experts_in_out:  # each layer's pair in one layout
            for layer in arch.moe_layers:
                fused = self.layer_name(layer, "mlp.experts.gate_up_proj")
                down = self.layer_name(layer, "mlp.experts.down_proj")
                if fused in self._file_of and down in self._file_of:
                    self._fused_in_out(fused, down, moe.intermediate_size)
        return checked

    def _fetch(
        self,
        name: str,
        dtype: torch.dtype | None,
        device: torch.device,
        dim: int = 0,
        ranges: Ranges | None = None,
    ) -> torch.Tensor:
        """Read one tensor, or only its ``ranges`` along ``dim`` (the bytes stored are what
        counts), and move it to device/dtype; a quantised one through its weight kernel."""
        fmt = self._stored_format(name)
        if fmt is None:
            tensor = self._read(name, dim, ranges)
            if self._may_be_quantised and tensor.is_floating_point():
                self._check_unquantised(name, tensor.dtype)
            return tensor.to(device=device, dtype=dtype or tensor.dtype)
        fmt, block = self._check_quantised(name, fmt, device)
        kernel = quant.weight_kernel_for(fmt, device)
        assert kernel is not None  # checked above
        shape = self._dequantised_shape(name, fmt)
        self._check_scale_shape(name, fmt, block, shape)
        q = quant.read_slice(name, fmt, block, shape, self._read, dim, ranges)
        return kernel.load(q, dtype or torch.float32, device)

    # --- quantised tensors ----------------------------------------------------------------------
    def _header(self, name: str) -> Any:
        file = self._file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _open(file)
        return handle.get_slice(name)

    def _stored_format(self, name: str) -> str | None:
        """``fp8`` (or ``fp8-block``), ``mxfp4``, ``nvfp4``, or None (stored as it is used)."""
        if not self._may_be_quantised:
            return None
        if name not in self._file_of:
            return "mxfp4" if name + "_blocks" in self._file_of else None
        dtype = self._header(name).get_dtype()
        if dtype == "F8_E4M3":
            return "fp8-block" if f"{name}_scale_inv" in self._file_of else "fp8"
        if dtype == "U8" and f"{name}_scale_2" in self._file_of:
            return "nvfp4"
        return None

    def precision(self) -> Precision:
        """The model's precision: given, or read from the folder's config."""
        if self._precision is None:
            from opweave.costmodel import load_model

            self._precision = load_model(self.model_dir).precision
        return self._precision

    def _check_quantised(
        self, name: str, fmt: str, device: torch.device
    ) -> tuple[str, tuple[int, int]]:
        """That ``name``, stored in ``fmt``, is what the config says, has its scales and a
        kernel here; returns the format the config says and the block one scale covers."""
        precision = self.precision()
        path, scheme = self._module_scheme(name)
        if scheme is not None and scheme.format in ("fp8", "fp8-block") and fmt.startswith("fp8"):
            fmt_said = scheme.format
        else:
            fmt_said = None if scheme is None else scheme.format
        if fmt_said is None:
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} is stored as {fmt} weights, but the config "
                f"({precision.source}) leaves {path} unquantised; the checkpoint and its "
                "quantization_config disagree"
            )
        if fmt_said != fmt and not (fmt_said.startswith("fp8") and fmt.startswith("fp8")):
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} is stored as {fmt} weights, but the config "
                f"({precision.source}) says {fmt_said}; the checkpoint and its "
                "quantization_config disagree"
            )
        missing = quant.missing_scale(name, fmt_said, self.has)
        if missing is not None:
            raise CheckpointError(
                f"{self.model_dir}: {fmt_said} tensor {name!r} has no scale tensor {missing!r}; "
                "the checkpoint is incomplete (export it again with its scales)"
            )
        if quant.weight_kernel_for(fmt_said, device) is None:
            raise UnsupportedModelError(
                f"no weight kernel loads {fmt_said} weights on {device.type} (tensor {name!r}); "
                "serve this checkpoint on a device that has one, or an unquantised checkpoint"
            )
        assert scheme is not None
        return fmt_said, quant.block_of(fmt_said, scheme.scale_rows, scheme.scale_cols)

    def _check_scale_shape(
        self, name: str, fmt: str, block: tuple[int, int], shape: tuple[int, ...]
    ) -> None:
        """A block-scaled tensor's scales have one entry per block of its values."""
        if fmt == "fp8":
            return
        scale = name + quant.FORMATS[fmt].scales[0]
        br, bc = block
        rows, cols = shape[-2], shape[-1]
        want = (*shape[:-2], -(-rows // br) if br else 1, -(-cols // bc) if bc else 1)
        got = tuple(self._header(scale).get_shape())
        if got != want:
            raise CheckpointError(
                f"{self.model_dir}: scale tensor {scale!r} has shape {list(got)}, but {fmt} "
                f"blocks of {br}x{bc} over {name!r} {list(shape)} need {list(want)}; the "
                "checkpoint and its quantization_config (weight_block_size) disagree"
            )

    def _module_scheme(self, name: str) -> tuple[str, WeightScheme | None]:
        """The module path of a checkpoint tensor and the scheme its config gives it."""
        path = name.removesuffix(".weight")
        if path.startswith(self.prefix):
            path = "model." + path[len(self.prefix) :]
        router = path.endswith((".gate", "shared_expert_gate"))
        expert = ".experts." in path
        return path, self.precision().scheme_for((path,), router=router, expert=expert)

    def _check_unquantised(self, name: str, dtype: torch.dtype) -> None:
        """A linear weight stored unquantised that the config says is quantised is refused."""
        if not _LINEAR_WEIGHT.search(name):
            return
        path, scheme = self._module_scheme(name)
        if scheme is not None:
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} is stored unquantised "
                f"({str(dtype).removeprefix('torch.')}), but the config "
                f"({self.precision().source}) quantises {path} as {scheme.format}; the "
                "checkpoint and its quantization_config disagree"
            )

    def _dequantised_shape(self, name: str, fmt: str) -> tuple[int, ...]:
        if fmt == "mxfp4":
            shape = list(self._header(name + "_blocks").get_shape())
            return (*shape[:-2], shape[-2] * shape[-1] * 2)
        shape = list(self._header(name).get_shape())
        if fmt == "nvfp4":
            return (*shape[:-1], shape[-1] * 2)
        return tuple(shape)

    def _read(self, name: str, dim: int = 0, ranges: Ranges | None = None) -> torch.Tensor:
        """One stored tensor as stored, or only its ``ranges`` along ``dim``; accounted."""
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not in checkpoint")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _open(file)
        if ranges is None:
            tensor = handle.get_tensor(name)
        else:
            view = handle.get_slice(name)
            shape = view.get_shape()
            if not 0 <= dim < len(shape):
                raise CheckpointError(
                    f"{self.model_dir}: tensor {name!r} has shape {shape}, no dimension {dim}"
                )
            parts = []
            for lo, hi in ranges:
                if not 0 <= lo < hi <= shape[dim]:
                    raise CheckpointError(
                        f"{self.model_dir}: tensor {name!r} has {shape[dim]} rows along "
                        f"dimension {dim}, the model config implies at least {hi}"
                    )
                index = tuple([slice(None)] * dim + [slice(lo, hi)])
                parts.append(view[index])
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        self._account(name, tensor)
        return tensor

    def close(self) -> None:
        """Drop file handles and the sharing cache (loaded tensors stay with their operators)."""
        self._handles.clear()
        super().close()

    # --- name mapping -------------------------------------------------------------------------

    def lm_head_name(self) -> str:
        """The output projection; tied models store only the input embedding."""
        for name in ("lm_head.weight", "language_model.lm_head.weight"):
            if name in self._file_of:
                return name
        return self.model_name("embed_tokens.weight")

    def moe_module(self, layer: int) -> str:
        """``mlp.`` (Qwen, transformers-5 Mixtral) or ``block_sparse_moe.`` (released Mixtral)."""
        if self.has(self.layer_name(layer, "block_sparse_moe.gate.weight")):
            return "block_sparse_moe."
        return "mlp."

    def load_experts(
        self,
        layer: int,
        num_experts: int,
        intermediate: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        channels: tuple[int, int] | None = None,
        experts: tuple[int, int] | None = None,
        in_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of a layer as ``gate_up [E, 2I, H]`` and ``down [E, H, I]``; with
        ``channels`` only those ``[lo, hi)`` intermediate channels of every expert (TP); with
        ``experts`` only those ``[lo, hi)`` experts (EP); with both, those channels of those
        experts.

        transformers 5 computes with this fused layout, so matching it keeps the matmul shapes (and
        hence the float rounding) the same as the reference; per-expert files are stacked to it.
        A fused file cut both ways is read one held expert at a time, whole, then cut. With
        ``in_out`` the fused files may also be stored ``[E, H, 2I]`` and ``[E, I, H]``
        (Qwen3-VL-MoE's released checkpoints), told apart by ``down_proj``'s shape and read
        transposed, as transformers does.
        """
        module = self.moe_module(layer)
        fused = self.layer_name(layer, f"{module}experts.gate_up_proj")
        if self.has(fused):
            down = self.layer_name(layer, f"{module}experts.down_proj")
            flip = in_out and self._fused_in_out(fused, down, intermediate)
            gate_up, down_t = self._fused_experts(
                fused, down, intermediate, flip, dtype, device, channels, experts
            )
            if flip:  # to transformers' compute layout
                return gate_up.transpose(1, 2).contiguous(), down_t.transpose(1, 2).contiguous()
            return gate_up, down_t
        gate_n, up_n, down_n = (
            ("w1", "w3", "w2")
            if module == "block_sparse_moe."
            else ("gate_proj", "up_proj", "down_proj")
        )
        rows = None if channels is None else [channels]
        gate_up, down = [], []
        for e in range(*(experts or (0, num_experts))):

            def part(n: str, dim: int, e: int = e) -> torch.Tensor:
                name = self.layer_name(layer, f"{module}experts.{e}.{n}.weight")
                return self.get(name, dtype=dtype, device=device, dim=dim, ranges=rows)

            gate_up.append(torch.cat([part(gate_n, 0), part(up_n, 0)], dim=0))
            down.append(part(down_n, 1))
        return torch.stack(gate_up), torch.stack(down)

    def _fused_in_out(self, fused: str, down: str, intermediate: int) -> bool:
        """Whether a layer's fused experts are stored ``[E, in, out]``: ``down_proj`` is
        ``[E, I, H]`` (or, where ``I == H``, ``gate_up_proj`` is ``[E, H, 2I]``); both tensors
        must agree, and the transposed layout is read unquantised only."""
        gate, d = self._shape(fused), self._shape(down)
        # down_proj tells the layouts apart unless it is square; gate_up_proj then does
        square = d[1] == d[2]
        flip = gate[2] == 2 * intermediate != gate[1] if square else d[1] == intermediate
        if (gate[2] if flip else gate[1]) != 2 * intermediate:
            raise CheckpointError(
                f"{self.model_dir}: {fused} {list(gate)} and {down} {list(d)} are stored in "
                "different layouts ([experts, in, out] and [experts, out, in]); write both alike"
            )
        if flip and (self._stored_format(fused) or self._stored_format(down)):
            raise CheckpointError(
                f"{self.model_dir}: {fused} is quantised and stored [experts, in, out]; the "
                "runtime reads that layout unquantised only (transformers 5 saves [experts, out, "
                "in])"
            )
        return flip

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's stored shape (its file header; packed values as they dequantise)."""
        fmt = self._stored_format(name)
        if fmt is not None:
            return self._dequantised_shape(name, fmt)
        return tuple(self._header(name).get_shape())

    def _fused_experts(
        self,
        fused: str,
        down: str,
        intermediate: int,
        flip: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        channels: tuple[int, int] | None,
        experts: tuple[int, int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused files' held experts and channels, in their stored layout: intermediate
        channels along ``gate_up``'s dim 1 and ``down``'s dim 2, or (``flip``) 2 and 1."""
        held = experts and [experts]
        if channels is None:
            return (
                self.get(fused, dtype=dtype, device=device, ranges=held),
                self.get(down, dtype=dtype, device=device, ranges=held),
            )
        lo, hi = channels
        pairs = [(lo, hi), (intermediate + lo, intermediate + hi)]
        g_dim, d_dim = (2, 1) if flip else (1, 2)
        if experts is None:
            return (
                self.get(fused, dtype=dtype, device=device, dim=g_dim, ranges=pairs),
                self.get(down, dtype=dtype, device=device, dim=d_dim, ranges=[channels]),
            )
        gate_ups, downs = [], []
        for e in range(*experts):
            one = [(e, e + 1)]
            whole = self.get(fused, dtype=dtype, device=device, ranges=one)
            gate_ups.append(torch.cat([whole.narrow(g_dim, a, b - a) for a, b in pairs], g_dim))
            part = self.get(down, dtype=dtype, device=device, ranges=one)
            downs.append(part.narrow(d_dim, lo, hi - lo))
        return torch.cat(gate_ups), torch.cat(downs)


def _stored_in_out(
    arch: Architecture, name: str, got: tuple[int, ...], want: tuple[int, ...]
) -> bool:
    """Whether ``got`` is a fused expert tensor of ``want`` stored ``[E, in, out]``, as a
    family whose released checkpoints store them so may (``ExpertsSpec.experts_in_out``)."""
    moe = arch.moe
    return (
        moe is not None
        and moe.experts_in_out
        and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        and len(want) == 3
        and got == (want[0], want[2], want[1])
    )


def _open(file: Path) -> Any:
    """A safetensors file's handle; a missing or malformed file is a one-line error."""
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors raises its own error types, and OSError
        text = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{file}: not a readable safetensors file ({text})") from None


# the linear weights a quantization_config may quantise (projections, experts, lm_head)
_LINEAR_WEIGHT = re.compile(
    r"(_proj|\.w[123])\.weight$|experts\.(gate_up|down)_proj$|lm_head\.weight$"
)
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def expected_shape(arch: Architecture, prefix: str, name: str) -> tuple[int, ...] | None:
    """The shape config.json implies for a checkpoint tensor the runtime reads, or ``None`` for
    a name it does not read (under ``prefix``, the decoder's: ``model.``, ...).

    >>> from opweave.costmodel import resolve_architecture
    >>> arch = resolve_architecture({"model_type": "llama", "hidden_size": 64,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "intermediate_size": 128, "vocab_size": 512})
    >>> expected_shape(arch, "model.", "model.layers.1.self_attn.k_proj.weight")
    (32, 64)
    """
    hidden, vocab = arch.hidden_size, arch.vocab_size
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return (vocab, hidden)
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    if rest == "embed_tokens.weight":
        return (vocab, hidden)
    if rest == "norm.weight":
        return (hidden,)
    m = _LAYER.fullmatch(rest)
    if m is None or int(m.group(1)) >= arch.num_layers:
        return None
    return _layer_shape(arch, int(m.group(1)), m.group(2))


def _layer_shape(arch: Architecture, layer: int, suffix: str) -> tuple[int, ...] | None:
    hidden, hd = arch.hidden_size, arch.head_dim
    if suffix in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
    ):
        return (hidden,)
    q = arch.num_heads * hd * (2 if arch.attn_output_gate else 1)
    kv = arch.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {}
    la = arch.linear_attn
    if arch.layer_types[layer] == LINEAR_ATTENTION and la is not None:
        a = "linear_attn."
        shapes |= {
            a + "in_proj_qkvz.weight": (2 * la.key_dim + 2 * la.value_dim, hidden),
            a + "in_proj_ba.weight": (2 * la.num_v_heads, hidden),
            a + "in_proj_qkv.weight": (la.conv_dim, hidden),  # Qwen3.5: four projections
            a + "in_proj_z.weight": (la.value_dim, hidden),
            a + "in_proj_b.weight": (la.num_v_heads, hidden),
            a + "in_proj_a.weight": (la.num_v_heads, hidden),
            a + "conv1d.weight": (la.conv_dim, 1, la.conv_kernel),
            a + "conv1d.bias": (la.conv_dim,),
            a + "A_log": (la.num_v_heads,),
            a + "dt_bias": (la.num_v_heads,),
            a + "norm.weight": (la.v_head_dim,),
            a + "out_proj.weight": (hidden, la.value_dim),
        }
    else:
        a = "self_attn."
        shapes |= {
            a + "q_proj.weight": (q, hidden),
            a + "q_proj.bias": (q,),
            a + "k_proj.weight": (kv, hidden),
            a + "k_proj.bias": (kv,),
            a + "v_proj.weight": (kv, hidden),
            a + "v_proj.bias": (kv,),
            a + "o_proj.weight": (hidden, arch.num_heads * hd),
            a + "o_proj.bias": (hidden,),
            a + "q_norm.weight": (arch.num_heads * hd,) if arch.qk_norm_per_layer else (hd,),
            a + "k_norm.weight": (kv,) if arch.qk_norm_per_layer else (hd,),
            a + "sinks": (arch.num_heads,),
        }
        if arch.mla is not None:
            shapes |= _mla_shapes(arch)
    moe = arch.moe
    if moe is not None and arch.is_moe_layer(layer):
        e, inter = moe.num_experts, moe.intermediate_size
        m = _EXPERT.fullmatch(suffix)
        if m is not None:
            if int(m.group(1)) >= e:
                return None
            return (hidden, inter) if m.group(2) in ("down_proj", "w2") else (inter, hidden)
        for module in ("mlp.", "block_sparse_moe."):
            shapes |= {
                module + "gate.weight": (e, hidden),
                module + "experts.gate_up_proj": (e, 2 * inter, hidden),
                module + "experts.down_proj": (e, hidden, inter),
            }
        if moe.score_correction_bias:
            shapes["mlp.gate.e_score_correction_bias"] = (e,)
            shapes["block_sparse_moe.e_score_correction_bias"] = (e,)
        if moe.expert_bias:  # gpt-oss: biased router, experts stored [E, in, out]
            shapes |= {
                "mlp.router.weight": (e, hidden),
                "mlp.router.bias": (e,),
                "mlp.experts.gate_up_proj": (e, hidden, 2 * inter),
                "mlp.experts.gate_up_proj_bias": (e, 2 * inter),
                "mlp.experts.down_proj": (e, inter, hidden),
                "mlp.experts.down_proj_bias": (e, hidden),
            }
        if moe.shared_intermediate_size:
            shared = moe.shared_intermediate_size
            for module in ("mlp.shared_expert.", "mlp.shared_experts."):
                shapes |= {
                    module + "gate_proj.weight": (shared, hidden),
                    module + "up_proj.weight": (shared, hidden),
                    module + "down_proj.weight": (hidden, shared),
                }
            shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    else:
        inter = arch.intermediate_size
        for proj in ("gate_proj", "up_proj"):
            shapes |= {f"mlp.{proj}.weight": (inter, hidden), f"mlp.{proj}.bias": (inter,)}
        shapes |= {"mlp.down_proj.weight": (hidden, inter), "mlp.down_proj.bias": (hidden,)}
    return shapes.get(suffix)


def _mla_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention tensors (``self_attn.``), from its latent geometry."""
    m, hidden, heads = arch.mla, arch.hidden_size, arch.num_heads
    assert m is not None
    q_out = heads * m.qk_head_dim
    a = "self_attn."
    shapes = {
        a + "q_proj.weight": (q_out, hidden),
        a + "kv_a_proj_with_mqa.weight": (m.latent_dim, hidden),
        a + "kv_a_proj_with_mqa.bias": (m.latent_dim,),
        a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        a + "o_proj.weight": (hidden, heads * m.v_head_dim),
    }
    if m.q_lora_rank:
        shapes |= {
            a + "q_a_proj.weight": (m.q_lora_rank, hidden),
            a + "q_a_proj.bias": (m.q_lora_rank,),
            a + "q_a_layernorm.weight": (m.q_lora_rank,),
            a + "q_b_proj.weight": (q_out, m.q_lora_rank),
        }
    return shapes


def check_weights(model_dir: str | Path, model: ModelSpec) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes its config implies, before
    any rank starts (reads the safetensors headers only)."""
    checkpoint = Checkpoint(model_dir)
    try:
        checkpoint.check_shapes(model.arch)
    finally:
        checkpoint.close()
