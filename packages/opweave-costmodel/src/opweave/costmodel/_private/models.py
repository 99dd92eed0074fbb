"""Model catalog: built-in configs shipped as package data, or any config on disk."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnknownModelError, not_a_file
from .base import DuplicateKeyError, loads_json
from .families import model_spec_from_config
from .model import ModelSpec

# name -> (data file, Hugging Face repo it was taken from)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "gemma-3-27b": ("gemma-3-27b.json", "google/gemma-3-27b-it"),
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b.json", "Qwen/Qwen3-Next-80B-A3B-Instruct"),
    "llama-3.3-70b": ("llama-3.3-70b.json", "meta-llama/Llama-3.3-70B-Instruct"),
    "qwen3-32b": ("qwen3-32b.json", "Qwen/Qwen3-32B"),
    "qwen3-30b-a3b": ("qwen3-30b-a3b.json", "Qwen/Qwen3-30B-A3B"),
    "deepseek-v3": ("deepseek-v3.json", "deepseek-ai/DeepSeek-V3"),
    "kimi-k2": ("kimi-k2.json", "moonshotai/Kimi-K2-Instruct"),
    "qwen3.5-397b-a17b": ("qwen3.5-397b-a17b.json", "Qwen/Qwen3.5-397B-A17B"),
    "minimax-m2.5": ("minimax-m2.5.json", "MiniMaxAI/MiniMax-M2.5"),
    "minimax-m2": ("minimax-m2.json", "MiniMaxAI/MiniMax-M2"),
    "qwen3-8b": ("qwen3-8b.json", "Qwen/Qwen3-8B"),
    "qwen3-235b-a22b": ("qwen3-235b-a22b.json", "Qwen/Qwen3-235B-A22B"),
    "qwen3-coder-480b-a35b": (
        "qwen3-coder-480b-a35b.json",
        "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    ),
}
# Where each built-in's config.json was copied from (the repo above is where it is published):
# deepseek-v3, qwen3.5-397b-a17b and minimax-m2.5 are byte copies of the configs in
# ai-dynamo/aiconfigurator aic-core/src/aiconfigurator_core/model_configs/ (commit 095f58a5);
# kimi-k2 is moonshotai/Kimi-K2-Instruct's config.json as quoted in full by a public model
# report (fields agree with the CSDN write-up https://blog.csdn.net/hbkybkzw/article/details/149370789).
# qwen3-coder-480b-a35b is a byte copy of aiconfigurator's
# model_configs/Qwen--Qwen3-Coder-480B-A35B-Instruct_config.json (fork xiaowanCN/aiconfigurator,
# commit 5f2e6bb0); qwen3-235b-a22b is the published Qwen/Qwen3-235B-A22B-FP8 config.json
# (tools/bench/configs/, aiconfigurator commit 095f58a5) without its quantization_config: its
# keys are those of the BF16 release's config.json (Qwen/Qwen3-235B-A22B, as quoted in full by
# public code, e.g. a LiteLLM registration of that repo id), whose weights are BF16. qwen3-8b is
# Qwen/Qwen3-8B's config.json as Qwen published it (transformers 4.51.0 layout); its values agree
# key for key with the copy in sanjithudupa/compute-aware-arch-search Qwen3-8B/config.json (a
# re-save by transformers 4.57.1, which adds layer_types and writes dtype). minimax-m2 holds the
# same keys and values as minimax-m2.5: MiniMaxAI/MiniMax-M2's config.json has the same
# architecture (62 layers, hidden 3072, 48/8 heads of 128, rotary_dim 64, 256 experts of 1536,
# top 8, vocab 200064, 196608 positions, block FP8 with gate, e_score_correction_bias and lm_head
# unconverted), as public readings of that file quote it, and NVIDIA's Megatron-Bridge documents
# M2.5 as "Same MiniMaxM2ForCausalLM architecture"; M2.1 has that architecture too.


def builtin_config(name: str) -> dict[str, Any]:
    """The shipped ``config.json`` of a built-in model."""
    file, _ = BUILTIN_MODELS[name]
    text = (resources.files("opweave.costmodel") / "data" / "models" / file).read_text()
    return json.loads(text)


def _read_json(path: Path, what: str) -> Any:
    try:
        return loads_json(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path} gives {exc.key!r} twice; keep one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix or re-download it") from None
    except ValueError:  # an integer of more than 4300 digits
        raise ConfigError(f"{path} holds a number too long to be {what}'s") from None
    except RecursionError:
        raise ConfigError(f"{path} nests JSON too deeply to be {what}") from None


def read_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` (or the one inside a model folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_symlink() and not path.exists():  # a cache snapshot whose blob is missing
        raise ConfigError(f"{path} {not_a_file(path)}")
    if not path.is_file():
        raise UnknownModelError(
            f"no config.json at {path}; give a built-in model name "
            f"({', '.join(BUILTIN_MODELS)}) or a Hugging Face model folder"
        )
    config = _read_json(path, "a model config")
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config


def hf_quant_config_path(path: str | Path) -> Path | None:
    """ModelOpt's ``hf_quant_config.json`` beside a config: in the model folder, beside a
    ``config.json``, or ``NAME.hf_quant_config.json`` beside a config file ``NAME.json``."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "hf_quant_config.json"]
    else:
        candidates = [path.with_name(f"{path.stem}.hf_quant_config.json")]
        if path.name == "config.json":
            candidates.append(path.with_name("hf_quant_config.json"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        if candidate.exists() or candidate.is_symlink():  # a folder, a pipe, a broken link
            raise ConfigError(
                f"{candidate} is not a readable file; ModelOpt's quantisation config must be "
                "its JSON file (remove it if the checkpoint is not quantised)"
            )
    return None


def read_hf_quant_config(path: Path) -> dict[str, Any]:
    data = _read_json(path, "a quantisation config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def load_model(
    model: str | Path,
    *,
    dtype: str | None = None,
    quant: str | None = None,
    kv_cache_dtype: str = "auto",
) -> ModelSpec:
    """A :class:`ModelSpec` for a built-in name or a path to a config / model folder.

    ``quant`` overrides the weight format of an unquantised checkpoint (default: the
    checkpoint's own), ``kv_cache_dtype`` (``auto`` or ``fp8``) the KV cache's.

    >>> load_model("qwen3-next-80b-a3b").block.period_layers
    4
    >>> round(load_model("qwen3-32b", quant="fp8").weight_bytes / 1e9, 1)  # 65.5 GB in bf16
    34.3
    """
    return _load_model(str(model), dtype, quant, kv_cache_dtype, _stamp(model))


def _stamp(model: str | Path) -> tuple[int, int] | None:
    """When and how large a model path's config files were last written, so that the cache
    below reads a config again once it changes (``None``: a built-in name or no such path)."""
    if str(model) in BUILTIN_MODELS:
        return None
    path = Path(model)
    files = [path / "config.json", path / "hf_quant_config.json"] if path.is_dir() else [path]
    stats = [f.stat() for f in files if f.is_file()]
    if not stats:
        return None
    return (max(s.st_mtime_ns for s in stats), sum(s.st_size for s in stats))


@lru_cache(maxsize=32)
def _load_model(
    model: str, dtype: str | None, quant: str | None, kv: str, stamp: tuple[int, int] | None
) -> ModelSpec:
    del stamp  # part of the cache key only
    precision = {"quant": quant, "kv_cache_dtype": kv}
    if model in BUILTIN_MODELS:
        return model_spec_from_config(builtin_config(model), name=model, dtype=dtype, **precision)
    path = Path(model)
    if not path.exists() and path.is_symlink():
        raise ConfigError(f"model path {model} {not_a_file(path)}")
    if not path.exists():
        raise UnknownModelError(
            f"unknown model {model!r}; use a built-in ({', '.join(BUILTIN_MODELS)}) "
            "or a path to a Hugging Face config.json or model folder"
        )
    # a model folder or its config.json is named by the folder; another config file by itself
    if path.is_dir():
        name = path.name
    elif path.name == "config.json":
        name = path.resolve().parent.name or path.stem
    else:
        name = path.stem
    file = path / "config.json" if path.is_dir() else path
    if not name.isprintable():
        raise ConfigError(
            f"{str(path)!r}: the model is named by its folder or file, and this name holds "
            "control characters (a newline, ...); rename it"
        )
    config = read_config(path)  # its errors name the file already
    quant_file = hf_quant_config_path(path)
    hf_quant = None if quant_file is None else read_hf_quant_config(quant_file)
    try:
        return model_spec_from_config(
            config, name=name, dtype=dtype, hf_quant_config=hf_quant, **precision
        )
    except ConfigError as exc:
        message = str(exc)
        if quant_file is not None and message.startswith("hf_quant_config.json"):
            where = message.removeprefix("hf_quant_config.json").lstrip(".: ")
            raise ConfigError(f"{quant_file}: {where}") from None
        raise ConfigError(f"{file}: {exc}") from None
