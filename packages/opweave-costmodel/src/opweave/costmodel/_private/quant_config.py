"""A checkpoint's precision, read from its ``quantization_config`` (config.json) or ModelOpt's
``hf_quant_config.json``, with the ``--quant`` and ``--kv-cache-dtype`` overrides.

Which file wins follows vLLM: config.json's ``quantization_config`` when there is one, else
``hf_quant_config.json`` (``get_config`` in transformers_utils/config.py promotes it to the
top level), else the ``quantization_config`` of a multimodal wrapper's ``text_config``
(``get_quant_config`` in model_executor/model_loader/weight_utils.py). What
each method leaves unquantised follows its engine convention, cited where it is read. The
KV-cache dtype ``auto`` is the model's dtype unless the checkpoint ships calibrated FP8 KV
scales (ModelOpt ``kv_cache_quant_algo: FP8``, compressed-tensors ``kv_cache_scheme``), in
which case vLLM serves an FP8 KV cache (vllm-project/vllm#29980, merged: "Load kv-cache dtype
from hf_quant_config.json automatically").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .architecture import Architecture
from .precision import (
    KV_CACHE_CHOICES,
    QUANT_CHOICES,
    UNQUANTISED,
    Precision,
    QuantRule,
    WeightScheme,
    exact_pattern,
    fp8_block_scheme,
    fp8_tensor_scheme,
    int4_scheme,
    mxfp4_scheme,
    nvfp4_scheme,
)

_MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "MIXED_PRECISION")
# what each layer of a ModelOpt MIXED_PRECISION checkpoint may be stored in
_MODELOPT_LAYER_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4")
_METHODS = ("fp8", "mxfp4", "awq", "gptq", "compressed-tensors", "modelopt")
# What `--quant X` on an unquantised checkpoint does (an engine's online quantisation, or a
# checkpoint made with the format's usual tool), named as the engine's method.
_OVERRIDE_SOURCE = {
    "fp8": "vLLM --quantization fp8: dynamic per-tensor FP8 of every decoder-layer linear",
    "fp8-block": "128x128 block FP8 of every decoder-layer linear, as DeepSeek/Qwen FP8 "
    "checkpoints store them",
    "nvfp4": "ModelOpt NVFP4 of every decoder-layer linear (its default recipe leaves lm_head "
    "and routers out)",
    "mxfp4": "MXFP4 routed experts, the rest unquantised, as gpt-oss ships (vLLM's mxfp4 "
    "method quantises experts only)",
    "int4-wo": "INT4 weight-only, group 128, symmetric (llm-compressor's W4A16 preset)",
}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed getters over one JSON object; errors name ``where.key``."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected an object, got {_show(data)}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise ConfigError(f"{self.where}.{key}: expected {_kind(kind)}, got {_show(value)}")
        return value

    def positive(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not 1 <= value <= 1 << 20:
            raise ConfigError(f"{self.where}.{key}: {value} is out of range (1..{1 << 20})")
        return value

    def names(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list, [])
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.where}.{key}: expected a list of module names")
        return tuple(value)

    def sub(self, key: str) -> _Reader | None:
        value = self.data.get(key)
        return None if value is None else _Reader(value, f"{self.where}.{key}")


def _kind(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", bool: "true or false", list: "a list"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def resolve_precision(
    config: Mapping[str, Any],
    arch: Architecture,
    *,
    quant: str | None = None,
    kv_cache_dtype: str = "auto",
    hf_quant_config: Mapping[str, Any] | None = None,
) -> Precision:
    """The precision a model is served in: the checkpoint's, or ``quant`` for an unquantised
    one; the KV cache per ``kv_cache_dtype`` (``auto``: the checkpoint's, else the model's)."""
    if kv_cache_dtype not in KV_CACHE_CHOICES:
        raise ConfigError(
            f"--kv-cache-dtype {kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_CHOICES)}"
        )
    found = checkpoint_precision(config, arch, hf_quant_config)
    if quant is not None:
        found = _override(found, arch, quant)
    if kv_cache_dtype == "fp8" and not found.kv_fp8:
        found = found.model_copy(update={"kv_fp8": True, "kv_source": "--kv-cache-dtype fp8"})
    return found


def _override(found: Precision, arch: Architecture, quant: str) -> Precision:
    unquantised = set(UNQUANTISED.values())
    if quant not in QUANT_CHOICES and quant not in unquantised:
        raise ConfigError(f"--quant {quant!r}: use one of {', '.join(QUANT_CHOICES)}")
    if found.quantized:
        if quant != found.quant:
            raise ConfigError(
                f"--quant {quant}: this checkpoint is already quantised ({found.quant}, "
                f"{found.source}) and is served in that format; drop --quant or use an "
                "unquantised checkpoint"
            )
        return found
    if quant in unquantised:
        return found
    if quant == "mxfp4" and arch.moe is None:
        raise ConfigError(
            f"--quant mxfp4 quantises routed experts only (as vLLM's mxfp4 method does), and "
            f"this {arch.family} model has none; choose another format"
        )
    scheme = {
        "fp8": fp8_tensor_scheme(),
        "fp8-block": fp8_block_scheme(),
        "nvfp4": nvfp4_scheme(),
        "mxfp4": mxfp4_scheme(),
        "int4-wo": int4_scheme(128, scale_bytes=found.dtype_bytes, tensor_bytes=16),
    }[quant]
    method = {"nvfp4": "modelopt-nvfp4", "mxfp4": "mxfp4", "int4-wo": "compressed-tensors"}
    return found.model_copy(
        update={
            "rules": (QuantRule(scheme=scheme),),
            "experts_only": quant == "mxfp4",
            "method": method.get(quant, "fp8"),
            "source": f"--quant {quant}: {_OVERRIDE_SOURCE[quant]}",
        }
    )


def checkpoint_precision(
    config: Mapping[str, Any], arch: Architecture, hf_quant_config: Mapping[str, Any] | None
) -> Precision:
    """The precision the checkpoint itself stores (unquantised when it says nothing)."""
    base = Precision(compute_dtype=arch.dtype)
    qc, where = config.get("quantization_config"), "quantization_config"
    if qc is None and hf_quant_config is None and isinstance(config.get("text_config"), Mapping):
        # a multimodal wrapper's text model; a ModelOpt export beside it comes first, since
        # vLLM promotes hf_quant_config.json to the top-level quantization_config
        qc, where = (
            config["text_config"].get("quantization_config"),
            "text_config.quantization_config",
        )
    if qc is not None:
        r = _Reader(qc, where)
        method = r.get("quant_method", str)
        producer = qc.get("producer") if isinstance(qc, Mapping) else None
        if method is None and isinstance(producer, Mapping) and producer.get("name") == "modelopt":
            # ModelOpt exports without quant_method (e.g. FP8 static per-tensor): vLLM takes
            # ModelOpt's own fields (quant_algo) as hf_quant_config.json states them
            method = "modelopt"
        if method is None:
            raise ConfigError(f"{r.where}.quant_method: missing; the checkpoint must say")
        method = method.lower()
        if method == "modelopt":
            return _modelopt(r, base, compressed_style=True)
        if method not in _METHODS:
            raise ConfigError(
                f"{r.where}.quant_method {method!r} is not modelled; OpWeave reads "
                f"{', '.join(_METHODS)} (and ModelOpt's hf_quant_config.json)"
            )
        if method == "mxfp4" and arch.moe is None:
            raise ConfigError(
                f"{r.where}.quant_method mxfp4 quantises routed experts only (vLLM's mxfp4 "
                f"method), and this {arch.family} model has none; the checkpoint cannot be one"
            )
        return {
            "fp8": _fp8,
            "mxfp4": _mxfp4,
            "awq": _awq,
            "gptq": _gptq,
            "compressed-tensors": _compressed_tensors,
        }[method](r, base)
    if hf_quant_config is not None:
        r = _Reader(hf_quant_config, "hf_quant_config.json")
        q = r.sub("quantization")
        if q is None:
            raise ConfigError("hf_quant_config.json: missing its 'quantization' object")
        return _modelopt(q, base, compressed_style=False)
    return base


# -- the methods ---------------------------------------------------------------------------
def _fp8(r: _Reader, base: Precision) -> Precision:
    """HF / vLLM ``fp8``: every linear of the decoder layers but ``modules_to_not_convert``;
    lm_head is not a LinearBase in vLLM (ParallelLMHead), so ``Fp8Config`` never quantises it,
    and transformers' FP8 quantiser keeps the output embedding out by default."""
    fmt = r.get("fmt", str, "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ConfigError(f"{r.where}.fmt {fmt!r}: OpWeave models FP8 E4M3 weights")
    activations = r.get("activation_scheme", str, "dynamic")
    if activations not in ("static", "dynamic"):  # vLLM's Fp8Config refuses any other
        raise ConfigError(
            f"{r.where}.activation_scheme {activations!r}: use static or dynamic, as vLLM does"
        )
    block = r.get("weight_block_size", list)
    if block is not None:
        if len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 1 << 16 for b in block
        ):
            raise ConfigError(
                f"{r.where}.weight_block_size: expected two positive integers, got {_show(block)}"
            )
        scheme = fp8_block_scheme(block[0], block[1])
        what = f"{block[0]}x{block[1]} blocks"
    else:
        scheme = fp8_tensor_scheme(static_input=activations == "static")
        what = "per-tensor scales"
    return base.model_copy(
        update={
            "rules": (QuantRule(scheme=scheme),),
            "ignore": r.names("modules_to_not_convert"),
            "method": "fp8",
            "source": f"config.json {r.where}: fp8, {what}",
        }
    )


def _mxfp4(r: _Reader, base: Precision) -> Precision:
    """gpt-oss's ``mxfp4``: routed experts only (vLLM's ``Mxfp4Config`` runs every other linear
    unquantised; the checkpoint lists attention, router, embeddings and lm_head out)."""
    return base.model_copy(
        update={
            "rules": (QuantRule(scheme=mxfp4_scheme()),),
            "ignore": r.names("modules_to_not_convert"),
            "experts_only": True,
            "method": "mxfp4",
            "source": f"config.json {r.where}: mxfp4 routed experts",
        }
    )


def _int4(r: _Reader, method: str) -> int | None:
    bits = r.get("bits", int, 4)
    if bits != 4:
        raise ConfigError(
            f"{r.where}.bits: {bits}-bit {method} is not modelled; OpWeave models "
            "4-bit weight-only checkpoints"
        )
    group = r.get("group_size", int, 128)
    if group == -1:
        return None  # one group per output channel
    if not 1 <= group <= 1 << 20:
        raise ConfigError(f"{r.where}.group_size: {group} is out of range")
    return group


def _awq(r: _Reader, base: Precision) -> Precision:
    group = _int4(r, "AWQ")
    zeros = r.get("zero_point", bool, True)
    return base.model_copy(
        update={
            "rules": (QuantRule(scheme=int4_scheme(group, zeros=zeros)),),
            "ignore": r.names("modules_to_not_convert"),
            "method": "awq",
            "source": f"config.json {r.where}: awq int4, group {group or 'channel'}",
        }
    )


def _gptq(r: _Reader, base: Precision) -> Precision:
    group = _int4(r, "GPTQ")
    if r.get("dynamic", dict):
        raise ConfigError(
            f"{r.where}.dynamic: per-module GPTQ overrides are not modelled; OpWeave "
            "models one GPTQ scheme for every linear"
        )
    # GPTQ checkpoints store qzeros and g_idx whether or not the scheme is symmetric
    return base.model_copy(
        update={
            "rules": (QuantRule(scheme=int4_scheme(group, zeros=True, g_idx=True)),),
            "lm_head": r.get("lm_head", bool, False),
            "method": "gptq",
            "source": f"config.json {r.where}: gptq int4, group {group or 'channel'}",
        }
    )


def _modelopt(r: _Reader, base: Precision, *, compressed_style: bool) -> Precision:
    """NVIDIA ModelOpt: every linear, lm_head and routed experts included, but
    ``exclude_modules`` (vLLM ``ModelOptQuantConfigBase.get_quant_method`` quantises LinearBase
    and ParallelLMHead unless excluded)."""
    where = f"config.json {r.where}" if compressed_style else "hf_quant_config.json"
    algo = r.get("quant_algo", str)
    if algo is None:
        raise ConfigError(f"{r.where}.quant_algo: missing; the checkpoint must say")
    algo = algo.upper()
    if algo not in _MODELOPT_ALGOS:
        raise ConfigError(
            f"{r.where}.quant_algo {algo!r} is not modelled; OpWeave reads ModelOpt "
            f"{', '.join(_MODELOPT_ALGOS)}"
        )
    if algo == "MIXED_PRECISION":
        rules, lm_head = _modelopt_layers(r)
    else:
        rules, lm_head = (QuantRule(scheme=_modelopt_scheme(r, algo)),), True
    if compressed_style:
        kv_value = r.data.get("kv_cache_scheme")
        if isinstance(kv_value, str):  # ModelOpt's own export names the algorithm
            kv_algo: str | None = kv_value
        else:
            kv = r.sub("kv_cache_scheme")
            kv_algo = None if kv is None else _kv_scheme(kv)
        ignore = r.names("ignore")
    else:
        kv_algo = r.get("kv_cache_quant_algo", str)
        ignore = r.names("exclude_modules")
    method = {"NVFP4": "modelopt-nvfp4", "MIXED_PRECISION": "modelopt-mixed"}.get(
        algo, "modelopt-fp8"
    )
    update: dict[str, Any] = {
        "rules": rules,
        "ignore": ignore,
        "lm_head": lm_head,
        "method": method,
        "source": f"{where}: ModelOpt {algo}",
    }
    if kv_algo is not None:
        if kv_algo.upper() != "FP8":
            key = "kv_cache_scheme" if compressed_style else "kv_cache_quant_algo"
            raise ConfigError(
                f"{r.where}.{key} {kv_algo!r}: OpWeave models an FP8 KV cache; "
                "pass --kv-cache-dtype fp8"
            )
        update |= {"kv_fp8": True, "kv_source": f"{where}: kv_cache_quant_algo FP8"}
    return base.model_copy(update=update)


def _modelopt_scheme(r: _Reader, algo: str) -> WeightScheme:
    """One ModelOpt algorithm's weight scheme (``group_size`` read from ``r`` for NVFP4)."""
    if algo in ("NVFP4", "W4A16_NVFP4"):
        group = r.positive("group_size", 16) or 16
        # W4A16: NVFP4 weights, activations kept in the compute dtype (weight-only GEMMs)
        return nvfp4_scheme(group).model_copy(update={"weight_only": algo == "W4A16_NVFP4"})
    if algo == "FP8_PB_WO":
        return fp8_block_scheme()  # vLLM runs it as block FP8 W8A8 (ModelOptFp8PbWoLinearMethod)
    return fp8_tensor_scheme(
        static_input=algo == "FP8", per_channel=algo == "FP8_PER_CHANNEL_PER_TOKEN"
    )


def _modelopt_layers(r: _Reader) -> tuple[tuple[QuantRule, ...], bool]:
    """A ModelOpt MIXED_PRECISION checkpoint's ``quantized_layers``: each linear's own
    algorithm (vLLM ``ModelOptMixedPrecisionConfig``); a linear not listed stays unquantised.
    Returns one rule per scheme, and whether lm_head is among the layers."""
    layers = r.sub("quantized_layers")
    if layers is None or not layers.data:
        raise ConfigError(
            f"{r.where}.quantized_layers: missing; a MIXED_PRECISION checkpoint "
            "lists each quantised layer"
        )
    by_scheme: dict[WeightScheme, list[str]] = {}
    for name, spec in layers.data.items():
        layer = _Reader(spec, f"{layers.where}.{name}")
        algo = (layer.get("quant_algo", str) or "").upper()
        if algo not in _MODELOPT_LAYER_ALGOS:
            raise ConfigError(
                f"{layer.where}.quant_algo {algo or None!r} is not modelled; OpWeave reads "
                f"ModelOpt {', '.join(_MODELOPT_LAYER_ALGOS)} layers"
            )
        by_scheme.setdefault(_modelopt_scheme(layer, algo), []).append(str(name))
    rules = tuple(QuantRule(targets=tuple(names), scheme=s) for s, names in by_scheme.items())
    lm_head = any(n.rsplit(".", 1)[-1] == "lm_head" for n in layers.data)
    return rules, lm_head


def _kv_scheme(kv: _Reader) -> str:
    """A compressed-tensors ``kv_cache_scheme`` as a ModelOpt-style algorithm name."""
    bits, kind = kv.get("num_bits", int), kv.get("type", str)
    if bits == 8 and kind == "float":
        return "FP8"
    raise ConfigError(
        f"{kv.where}: a {bits}-bit {kind} KV cache is not modelled; OpWeave models an FP8 one"
    )


def _compressed_tensors(r: _Reader, base: Precision) -> Precision:
    """llm-compressor's compressed-tensors: ``config_groups`` of targets and a scheme, and an
    ``ignore`` list (vLLM ``CompressedTensorsConfig``; lm_head, a ParallelLMHead, is never
    targeted as a Linear)."""
    groups = r.sub("config_groups")
    if groups is None or not groups.data:
        raise ConfigError(f"{r.where}.config_groups: missing; the checkpoint must say")
    rules = []
    for name in groups.data:
        g = groups.sub(str(name))
        assert g is not None
        weights = g.sub("weights")
        if weights is None:
            continue
        targets = g.names("targets")
        if not targets:
            raise ConfigError(f"{g.where}.targets: expected the modules it applies to")
        rules.append(QuantRule(targets=targets, scheme=_ct_scheme(weights, g, base)))
    update: dict[str, Any] = {
        "rules": tuple(rules),
        "ignore": tuple(exact_pattern(name) for name in r.names("ignore")),
        "method": "compressed-tensors",
        "source": f"config.json {r.where}: compressed-tensors "
        + ", ".join(sorted({q.scheme.format for q in rules}) or ["(no weights)"]),
    }
    kv = r.sub("kv_cache_scheme")
    if kv is not None:
        _kv_scheme(kv)
        update |= {"kv_fp8": True, "kv_source": f"config.json {r.where}: kv_cache_scheme"}
    elif not rules:
        raise ConfigError(
            f"{groups.where}: no group quantises weights (each group's weights is null) and "
            "there is no kv_cache_scheme: the config quantises nothing; remove it or give "
            "the groups' weights"
        )
    return base.model_copy(update=update)


def _ct_scheme(w: _Reader, g: _Reader, base: Precision) -> WeightScheme:
    bits, kind = w.get("num_bits", int), w.get("type", str, "int")
    strategy = w.get("strategy", str, "tensor")
    acts = g.sub("input_activations")
    what = f"{w.where}: {bits}-bit {kind} weights, strategy {strategy!r}"
    if kind == "float" and bits == 8:
        if strategy == "block":
            block = w.get("block_structure", list)
            if (
                block is None
                or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
            ):
                raise ConfigError(f"{w.where}.block_structure: expected two positive integers")
            return fp8_block_scheme(block[0], block[1])
        if strategy in ("tensor", "channel"):
            static = acts is not None and not acts.get("dynamic", bool, False)
            return fp8_tensor_scheme(static_input=static, per_channel=strategy == "channel")
    if kind == "float" and bits == 4 and strategy == "tensor_group":
        if acts is None or acts.get("num_bits", int) != 4:
            raise ConfigError(f"{what} with 16-bit activations (NVFP4A16) is not modelled")
        return nvfp4_scheme(w.positive("group_size", 16) or 16)
    if kind == "int" and bits == 4 and acts is None and strategy in ("group", "channel"):
        group = w.positive("group_size") if strategy == "group" else None
        if strategy == "group" and group is None:
            raise ConfigError(f"{w.where}.group_size: missing for strategy 'group'")
        return int4_scheme(
            group,
            scale_bytes=base.dtype_bytes,
            zeros=not w.get("symmetric", bool, True),
            g_idx=w.get("actorder", str) == "group",
            tensor_bytes=16,  # weight_shape, int64[2]
        )
    raise ConfigError(
        f"{what} is not modelled; OpWeave reads compressed-tensors FP8 (tensor, channel, "
        "block), NVFP4 (W4A4) and INT4 weight-only (group, channel)"
    )
