"""Fuzzing every file format and numeric flag of the CLI (DESIGN.md, Testing).

Whatever hypothesis generates -- model configs, plans, profiles, hardware TOML, prompts JSONL,
tokenizers, and the numeric flags of every command -- the command either succeeds with a valid
result or exits with status 2 and one ``error:`` line, in under 10 s, without a traceback
(:func:`tests.fuzzing.check`). Where a command would start real work past its checks (``run``'s
ranks, ``profile``'s timing), a stand-in records what the library was handed, and the test
asserts it is valid.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opweave.costmodel import (
    BUILTIN_MODELS,
    KV_CACHE_CHOICES,
    QUANT_CHOICES,
    canonical_plan,
    default_catalog,
    load_model,
    synthesize_profile,
)
from opweave.costmodel._private.models import builtin_config
from tests.fuzzing import (
    OUTCOMES,
    SLOWEST,
    Reached,
    check,
    check_output,
    deep,
    finite_or_none,
    invoke,
    json_values,
    mutated,
    numbers,
)
from tests.helpers import GLM_4_5, IMAGE, QWEN3_5_27B, TINY_LLAMA

FUZZ = settings(
    max_examples=60,
    deadline=None,  # no time bound per input (the load decides it); a runaway one meets pytest's
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the suite's time stays what it was measured at
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def tiny_config(root: Path) -> Path:
    folder = root / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama with weights and a tokenizer (``run`` reads both)."""
    from opweave.runtime import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("fuzz-model") / "llama")


@pytest.fixture(scope="module")
def stand_ins():
    """``run_plan`` and ``profile_model`` raise :class:`Reached` with their arguments."""

    def reach(*args: Any, **kwargs: Any) -> None:
        raise Reached(args=args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        import opweave.profiler
        import opweave.runtime

        mp.setattr(opweave.runtime, "run_plan", reach)
        mp.setattr(opweave.profiler, "profile_model", reach)
        yield


@pytest.fixture(scope="module", autouse=True)
def report():
    """Print what the inputs came to (``pytest -s`` shows it)."""
    yield
    for key, count in sorted(OUTCOMES.items()):
        print(f"fuzz {key}: {count}")
    for name, (seconds, shown) in sorted(SLOWEST.items()):
        print(f"fuzz {name}: slowest {seconds:.2f} s: opweave {shown[:200]}")


_serial = itertools.count()


def _fresh(root: Path, name: str, like: Path | None = None) -> Path:
    """A new folder per input: ``load_model`` caches by path, so a config rewritten in place
    would be read once."""
    folder = root / f"{name}-{next(_serial)}"
    if like is None:
        folder.mkdir()
    else:
        shutil.copytree(like, folder)
    return folder


def _write(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))  # NaN / Infinity spelled as JSON's readers take them
    return path


# -- numeric flags --------------------------------------------------------------------------
ESTIMATE_FLAGS = ("--tp", "--batch", "--context")
ANALYZE_FLAGS = ("--contexts", "--tp")
PLAN_FLAGS = ("--context", "--tpot-slo-ms", "--batch", "--microbatches", "--max-owners")


@FUZZ
@given(flag=st.sampled_from(ESTIMATE_FLAGS), value=numbers)
def test_estimate_flags(flag: str, value: str) -> None:
    args = ["estimate", "qwen3-32b", "--gpu", "h100", f"{flag}={value}", "--json"]
    if check("estimate flags", args) == 0:
        assert value.strip()


SERVING_FLAGS = ("--isl", "--osl", "--concurrency", "--rate", "--max-num-batched-tokens")


@FUZZ
@given(flag=st.sampled_from(SERVING_FLAGS), value=numbers)
def test_estimate_serving_flags(flag: str, value: str) -> None:
    """Aggregated serving with one flag fuzzed: an estimate, or one ``error:`` line."""
    given = {"--isl": "1K", "--osl": "256", "--concurrency": "8"} | {flag: value}
    if flag == "--rate":
        del given["--concurrency"]
    args = ["estimate", "qwen3-32b", "--gpu", "h100", "--tp", "2", "--json"]
    code, out = check_output("estimate serving", [*args, *(f"{f}={v}" for f, v in given.items())])
    if code == 0:
        assert json.loads(out)["tpot_s"] > 0


PARALLEL_FLAGS = ("--tp", "--ep", "--dp", "--expert-imbalance", "--batch")
degrees = st.one_of(st.sampled_from(("1", "2", "4", "8", "16", "32", "64", "72", "128")), numbers)


@FUZZ
@given(
    values=st.lists(
        st.tuples(st.sampled_from(PARALLEL_FLAGS), degrees),
        min_size=1,
        max_size=4,
        unique_by=lambda x: x[0],
    )
)
def test_estimate_parallelism_flags(values: list[tuple[str, str]]) -> None:
    """(TP, EP, DP) on a MoE model: a legal layout's estimate, or one ``error:`` line."""
    args = ["estimate", "qwen3-30b-a3b", "--gpu", "h200", "--context", "4K", "--json"]
    code, out = check_output("estimate parallelism", [*args, *(f"{f}={v}" for f, v in values)])
    if code == 0:
        doc = json.loads(out)
        assert (doc["tp"] * doc["dp"]) % doc["ep"] == 0
        assert doc["step_latency_s"] == pytest.approx(sum(doc["breakdown_s"].values()))
        assert (doc["expert_imbalance"] is None) == (doc["ep"] == 1)


@FUZZ
@given(flag=st.sampled_from(ANALYZE_FLAGS), value=numbers)
def test_analyze_flags(flag: str, value: str) -> None:
    check("analyze flags", ["analyze", "qwen3-32b", "--gpus", "h100", f"{flag}={value}", "--json"])


@FUZZ
@given(flag=st.sampled_from(PLAN_FLAGS), value=numbers)
def test_plan_flags(flag: str, value: str, tiny_config: Path) -> None:
    args = {"--context": "256", "--tpot-slo-ms": "50", "--gpus": "h100"}
    args[flag] = value
    if flag == "--batch":
        args["--microbatches"] = "1"
    argv = ["plan", str(tiny_config), *(f"{k}={v}" for k, v in args.items()), "--json"]
    check("plan flags", argv)


PROFILE_FLAGS = (
    "--tp",
    "--batches",
    "--contexts",
    "--warmup",
    "--repeats",
    "--passes",
    "--working-set-mib",
    "--threads",
    "--usd-per-hour",
    "--seed",
)


@FUZZ
@given(flag=st.sampled_from(PROFILE_FLAGS), value=numbers)
def test_profile_flags(flag: str, value: str, tiny_config: Path, root: Path, stand_ins) -> None:
    out = root / "profile.json"
    got = check(
        "profile flags", ["profile", "-m", str(tiny_config), "-o", str(out), f"{flag}={value}"]
    )
    if isinstance(got, Reached):  # what the profiler would have been asked to do is valid
        kw = got.kwargs
        assert kw["usd_per_hour"] is None or (
            math.isfinite(kw["usd_per_hour"]) and kw["usd_per_hour"] > 0
        )
        ws = kw["working_set_bytes"]
        assert ws is None or (math.isfinite(ws) and ws >= 0)
        assert all(1 <= c <= TINY_LLAMA["max_position_embeddings"] for c in kw["contexts"] or [])
        assert all(b >= 1 for b in kw["batches"] or [])
        assert set(kw["tp"]) <= {1, 2, 4, 8}
        assert 0 <= kw["seed"] < 2**32


RUN_FLAGS = (
    "--tp",
    "--replicas",
    "--batch",
    "--microbatches",
    "--ranks",
    "--max-tokens",
    "--timeout-s",
    "--nnodes",
    "--node-rank",
    "--master-port",
)


@FUZZ
@given(flag=st.sampled_from(RUN_FLAGS), value=numbers)
def test_run_flags(flag: str, value: str, model_dir: Path, stand_ins) -> None:
    argv = ["run", "--model-path", str(model_dir), "--prompt", "t5 t6 t7", "--max-tokens", "4"]
    got = check("run flags", [*argv, f"{flag}={value}", "--json"])
    if isinstance(got, Reached):
        plan, _, requests, options = got.kwargs["args"]
        assert math.isfinite(options.timeout_s) and 0.1 <= options.timeout_s <= 86400
        for r in requests:
            assert len(r.prompt_token_ids) + r.max_new_tokens <= 512  # the tiny model's context
        assert all(o.tp in (1, 2, 4, 8) for o in plan.owners)


@pytest.fixture(scope="module")
def serve_stand_in():
    """vLLM's server, where vLLM is installed, replaced by a stand-in; without vLLM, serving
    stops at "serving needs vLLM" after the same checks."""
    if find_spec("vllm") is None:
        yield False
        return

    def reach(*args: Any, **kwargs: Any) -> None:
        raise Reached(args=args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        import opweave.runtime.vllm.serve

        mp.setattr(opweave.runtime.vllm.serve, "serve", reach)
        yield True


@FUZZ
@given(flag=st.sampled_from(["--port", "--timeout-s", "--tp", "--replicas"]), value=numbers)
def test_serving_flags(flag: str, value: str, model_dir: Path, serve_stand_in: bool) -> None:
    got = check("serve flags", ["run", "--model-path", str(model_dir), f"{flag}={value}"])
    if isinstance(got, Reached):
        assert 1 <= got.kwargs["port"] <= 65535
        assert math.isfinite(got.kwargs["additional_config"]["opweave_timeout_s"])
    else:
        assert got == 2


# -- model configs --------------------------------------------------------------------------
CONFIG_KEYS = sorted(
    {k for name in BUILTIN_MODELS for k in builtin_config(name)}
    | {k for k in builtin_config("gemma-3-27b")["text_config"]}
    | {k for k in builtin_config("qwen3.5-397b-a17b")["text_config"]}
    | set(TINY_LLAMA)
    | {"layer_types", "quantization_config", "rope_parameters", "mlp_only_layers", "head_dim"}
)
CONFIGS = [TINY_LLAMA, *(builtin_config(name) for name in BUILTIN_MODELS)]


@FUZZ
@given(
    config=st.sampled_from(range(len(CONFIGS))).flatmap(lambda i: mutated(CONFIGS[i], CONFIG_KEYS))
)
def test_model_configs(config: Any, root: Path) -> None:
    folder = _fresh(root, "config")
    _write(folder / "config.json", config)
    check("model config", ["estimate", str(folder), "--gpu", "h100", "--json"])


NEW_FAMILIES = (
    "deepseek-v3",
    "kimi-k2",
    "qwen3.5-397b-a17b",
    "minimax-m2.5",
    "qwen3.5-27b",
    "glm-4.5",
)
# released configs of families without a built-in model (tests.helpers holds them)
_RELEASED = {"qwen3.5-27b": QWEN3_5_27B, "glm-4.5": GLM_4_5}


def _config(name: str) -> dict[str, Any]:
    """A fresh copy of a built-in's config, or of a released config the tests hold."""
    if name in _RELEASED:
        return json.loads(json.dumps(_RELEASED[name]))
    return builtin_config(name)


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def _numeric_keys(name: str) -> list[str]:
    """The numeric keys of a config's text model (see ``_config``) that its family reads."""
    from opweave.costmodel._private.config_fields import field_names
    from opweave.costmodel._private.registry import resolve_family

    config = _config(name)
    schema = resolve_family(config)[0].schema
    read = {
        n for f, info in schema.model_fields.items() for n in field_names(f, info.validation_alias)
    }
    return sorted(
        k
        for k, v in _text(config).items()
        if k in read and isinstance(v, int | float) and not isinstance(v, bool)
    )


@FUZZ
@given(data=st.data())
def test_new_family_config_fields(data: st.DataObject, root: Path) -> None:
    """DeepSeek-V3 (Kimi-K2), Qwen3.5, MiniMax-M2 and GLM-4.5 configs with one of their numeric keys
    replaced: an estimate, or exit 2 with one error line."""
    name = data.draw(st.sampled_from(NEW_FAMILIES))
    config = _config(name)
    key = data.draw(st.sampled_from(_numeric_keys(name)))
    _text(config)[key] = data.draw(st.one_of(json_values, st.sampled_from([0, -1, 10**9, 1.5])))
    folder = _fresh(root, "family")
    _write(folder / "config.json", config)
    check("new family field", ["estimate", str(folder), "--gpu", "h200", "--tp", "8", "--json"])


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_new_family_fields_of_the_wrong_type_name_the_field(name: str, root: Path) -> None:
    for key in _numeric_keys(name):
        config = _config(name)
        _text(config)[key] = "x"
        folder = _fresh(root, "typed")
        path = _write(folder / "config.json", config)
        code, out, err, _ = invoke(["estimate", str(folder), "--gpu", "h200", "--json"])
        assert code == 2 and out == ""
        assert err.startswith(f"error: {path}: {key}: expected a"), err
        assert err.endswith(", got 'x'\n"), err


@settings(FUZZ, max_examples=20)
@given(
    content=st.one_of(
        st.binary(max_size=64),
        st.just(deep(100_000)),
        st.just('{"model_type": "llama", "hidden_size": ' + deep(50_000) + "}"),
        st.just('{"model_type": "llama", "num_hidden_layers": 1' + "0" * 5000 + "}"),
        json_values.map(json.dumps),
    )
)
def test_model_config_files_that_are_not_configs(content: Any, root: Path) -> None:
    folder = _fresh(root, "raw-config")
    _write(folder / "config.json", content)
    check("config file", ["estimate", str(folder), "--gpu", "h100", "--json"])


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_model_configs_against_their_weights(
    data: st.DataObject, model_dir: Path, root: Path, stand_ins
) -> None:
    """``run`` with a config edited beside the weights: a refusal (often naming the tensor that
    no longer fits) or a run whose every tensor has the shape the config implies."""
    folder = _fresh(root, "run-model", like=model_dir)
    real = json.loads((model_dir / "config.json").read_text())
    _write(folder / "config.json", data.draw(mutated(real, CONFIG_KEYS)))
    argv = ["run", "--model-path", str(folder), "--prompt", "t5 t6", "--max-tokens", "2"]
    check("config vs weights", argv)


# -- precision: flags, quantization_config, hf_quant_config.json -------------------------------
precision_values = st.one_of(
    st.sampled_from(
        [*QUANT_CHOICES, *KV_CACHE_CHOICES, "fp16", "fp32", "FP8", "int8", "", " ", "fp8 ",
         "nvfp4,fp8", "\x00", "auto"]
    ),
    st.text(max_size=12),
)  # fmt: skip


@FUZZ
@given(
    flag=st.sampled_from(["--quant", "--kv-cache-dtype"]), value=precision_values, data=st.data()
)
def test_precision_flags(flag: str, value: str, data: st.DataObject, tiny_config: Path) -> None:
    model = data.draw(st.sampled_from(["qwen3-30b-a3b", str(tiny_config)]))
    check("precision flags", ["estimate", model, "--gpu", "h100", f"{flag}={value}", "--json"])
    argv = ["plan", str(tiny_config), "--gpus", "h100", "--context", "256", "--tpot-slo-ms", "50"]
    check("precision flags: plan", [*argv, f"{flag}={value}", "--json"])


TINY_MOE = dict(
    TINY_LLAMA,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    head_dim=16,
)
QUANTIZATION_CONFIGS = [
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128],
     "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "re:.*norm"]},
    {"quant_method": "fp8", "activation_scheme": "static"},
    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
     "modules_to_not_convert": ["gate"]},
    {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True,
     "lm_head": False},
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
         "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
         "symmetric": False, "actorder": "group"}}},
     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
     "config_groups": {"group_0": {"targets": ["re:.*mlp.*"],
         "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                     "group_size": 16},
         "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                               "group_size": 16, "dynamic": "local"}},
         "group_1": {"targets": ["re:.*self_attn.*"], "weights": {
             "num_bits": 8, "type": "float", "strategy": "block",
             "block_structure": [128, 128]}}}},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"],
     "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
]  # fmt: skip
QUANT_KEYS = [
    "quant_method", "weight_block_size", "modules_to_not_convert", "bits", "group_size",
    "config_groups", "ignore", "kv_cache_scheme", "quant_algo", "fmt", "lm_head", "dynamic",
    "zero_point", "activation_scheme",
]  # fmt: skip


@FUZZ
@given(data=st.data())
def test_quantization_configs(data: st.DataObject, root: Path) -> None:
    base = data.draw(st.sampled_from([TINY_LLAMA, TINY_MOE]))
    quant = data.draw(
        st.sampled_from(QUANTIZATION_CONFIGS).flatmap(lambda q: mutated(q, QUANT_KEYS))
    )
    folder = _fresh(root, "quant")
    _write(folder / "config.json", dict(base, quantization_config=quant))
    check("quantization_config", ["estimate", str(folder), "--gpu", "h100", "--json"])


HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.22.1"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": "FP8",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1*"],
    },
}


@FUZZ
@given(
    content=st.one_of(
        mutated(HF_QUANT_CONFIG, ["quant_algo", "kv_cache_quant_algo", "exclude_modules"]),
        json_values,
        st.binary(max_size=32),
        st.just(deep(100_000)),
    ),
    gpu=st.sampled_from(["h100", "a100", "mi300x"]),
)
def test_hf_quant_config_files(content: Any, gpu: str, root: Path) -> None:
    folder = _fresh(root, "modelopt")
    _write(folder / "config.json", TINY_MOE)
    _write(folder / "hf_quant_config.json", content)
    check("hf_quant_config.json", ["estimate", str(folder), "--gpu", gpu, "--json"])


# -- plans ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_doc(tiny_config: Path) -> dict[str, Any]:
    plan = canonical_plan(load_model(tiny_config), "afd", gpu="h100", batch=4, microbatches=2)
    return json.loads(plan.model_dump_json())


@FUZZ
@given(data=st.data())
def test_plan_files(data: st.DataObject, plan_doc: dict[str, Any], tiny_config, root) -> None:
    doc = data.draw(mutated(plan_doc, ["prediction", "profiles", "tpot_slo_s"]))
    path = _write(root / "plan.json", doc)
    check("plan file: simulate", ["simulate", str(path), "--model", str(tiny_config), "--json"])
    check("plan file: deploy", ["deploy", str(path), "-o", str(root / "deploy"), *IMAGE, "--json"])


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_plan_files_run(data: st.DataObject, model_dir: Path, root: Path, stand_ins) -> None:
    plan = canonical_plan(load_model(model_dir), "cad", gpu="cpu", batch=2, microbatches=2)
    doc = data.draw(mutated(json.loads(plan.model_dump_json())))
    path = _write(root / "run-plan.json", doc)
    argv = ["run", str(path), "--model-path", str(model_dir), "--prompt", "t5", "--max-tokens", "2"]
    check("plan file: run", argv)


# -- profiles -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def profile_doc(tiny_config: Path) -> dict[str, Any]:
    cpu = default_catalog().get("l4").model_copy(update={"id": "cpu", "name": "a CPU"})
    profile = synthesize_profile(load_model(tiny_config), cpu, batches=(1, 4), contexts=(16, 256))
    return json.loads(profile.model_dump_json())


@FUZZ
@given(data=st.data())
def test_profile_files(data: st.DataObject, profile_doc, tiny_config: Path, root: Path) -> None:
    doc = data.draw(mutated(profile_doc, ["idle_slowdown", "orchestration", "stall_overhead"]))
    path = _write(root / "profile.json", doc)
    argv = ["plan", str(tiny_config), "--gpus", "cpu", "--profile", str(path)]
    argv += ["--context", "64", "--tpot-slo-ms", "200", "--json"]
    check("profile file", argv)


# -- hardware files ---------------------------------------------------------------------------
HARDWARE_FIELDS = sorted(
    set(default_catalog().get("h100").model_dump()) | {"schema_version", "gpus", "idd"}
)
ids = st.sampled_from(["h100", "H100", "h100-sxm", "a100", "", " ", "my-accel", "MY-ACCEL"])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{json.dumps(str(k))} = {_toml_value(v)}"
                for k, v in value.items()
                if v is not None
            )
            + "}"
        )
    return '""'


@st.composite
def hardware_files(draw: st.DrawFn) -> str:
    pick = draw(st.randoms(use_true_random=False))
    version = pick.choice(["1"] * 6 + ["2", "0", "1.0", "true"])
    lines = [f"schema_version = {version}"] if pick.random() < 0.8 else []
    for _ in range(draw(st.integers(0, 3))):
        lines.append("[[gpus]]")
        if pick.random() < 0.9:
            name = (
                draw(ids)
                if pick.random() < 0.8
                else draw(st.text(st.characters(codec="utf-8"), max_size=6))
            )
            lines.append(f"id = {json.dumps(name)}")
        fields = pick.sample(HARDWARE_FIELDS, pick.randrange(6))
        for name in fields:
            plausible = st.floats(1e-6, 1e15) | st.integers(1, 8)  # often a valid value
            value = draw(
                st.one_of(
                    plausible,
                    plausible,
                    plausible,
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 1e12, 3.0, 0.5, "x", True]),
                    json_values,
                )
            )
            if value is not None:
                lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=hardware_files())
def test_hardware_files(text: str, root: Path) -> None:
    path = _write(root / "hw.toml", text)
    code, out = check_output("hardware file", ["gpus", "--hardware", str(path), "--json"])
    if code != 0:
        return
    gpus = json.loads(out)["gpus"]
    assert len({g["id"] for g in gpus}) == len(gpus) and all(g["id"] for g in gpus)
    for g in gpus:
        assert finite_or_none(g)
        assert g["memory_bytes"] > 0 and g["mem_bandwidth_bytes_per_s"] > 0
        assert g["usd_per_hour"] is None or g["usd_per_hour"] > 0


# The FP8/FP4 rates and efficiencies and the rack-scale NVLink domain, drawn together on the GPUs
# that have them and on those that do not: a file is read back as written, or refused in one line.
bad_values = st.sampled_from([0, -1, 0.0, 1.5, 72.0, "x", True]) | st.floats(
    allow_nan=True, allow_infinity=True
)
PRECISION_FIELDS = {  # each field: values that often suit it, and any value at all
    "fp8_flops_per_s": st.floats(1e12, 2e16),
    "fp4_flops_per_s": st.floats(1e12, 2e16),
    "fp8_compute_efficiency": st.floats(0.01, 1.0),
    "fp4_compute_efficiency": st.floats(0.01, 1.0),
    "nvlink_domain_gpus": st.sampled_from([1, 2, 4, 8, 16, 36, 72, 144]),
    "gpus_per_node": st.sampled_from([1, 2, 4, 8]),
}


@st.composite
def precision_fields(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(PRECISION_FIELDS)), max_size=4, unique=True))
    good = st.floats(0, 1)  # how often a field gets a value of its kind
    return {
        name: draw(PRECISION_FIELDS[name] if draw(good) < 0.8 else bad_values) for name in names
    }


@FUZZ
@given(
    gpu=st.sampled_from(["gb200", "gb300", "b300", "a100", "h100", "rtx-pro-6000"]),
    fields=precision_fields(),
)
def test_hardware_files_with_precision_rates_and_nvlink_domains(
    gpu: str, fields: dict[str, Any], root: Path
) -> None:
    text = f'schema_version = 1\n[[gpus]]\nid = "{gpu}"\n'
    text += "".join(f"{name} = {_toml_value(value)}\n" for name, value in fields.items())
    path = _write(root / "hw-precision.toml", text)
    argv = ["gpus", "--hardware", str(path), "--json"]
    code, out = check_output("hardware file (precision)", argv)
    if code != 0:
        return
    got = {g["id"]: g for g in json.loads(out)["gpus"]}[default_catalog().resolve(gpu)]
    for name, value in fields.items():
        assert got[name] == value, name
    for fmt in ("fp8", "fp4"):
        if got[f"{fmt}_compute_efficiency"] is not None:
            assert got[f"{fmt}_flops_per_s"] is not None
    if got["nvlink_domain_gpus"] is not None:
        assert got["nvlink_domain_gpus"] % got["gpus_per_node"] == 0


@settings(FUZZ, max_examples=20)
@given(
    content=st.binary(max_size=80)
    | st.just("[[gpus]]\nid = " + deep(5000))
    | st.text(st.characters(codec="utf-8"), max_size=40)
)
def test_hardware_files_that_are_not_toml(content: Any, root: Path) -> None:
    path = _write(root / "raw-hw.toml", content)
    check(
        "hardware file (raw)", ["estimate", "qwen3-32b", "--gpu", "h100", "--hardware", str(path)]
    )


# -- prompts and tokenizers -----------------------------------------------------------------
prompt_lines = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=20) | json_values},
        optional={"max_tokens": json_values | st.integers(-5, 600)},
    ),
    st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(st.integers(-3, 600), max_size=8) | json_values},
        optional={"max_tokens": json_values | st.integers(-5, 600)},
    ),
    json_values,
)


@FUZZ
@given(
    content=st.one_of(
        st.lists(prompt_lines, min_size=0, max_size=4).map(
            lambda lines: "\n".join(json.dumps(x) for x in lines)
        ),
        st.binary(max_size=60),
        st.just('{"prompt_token_ids": ' + deep(20_000) + "}"),
        st.just('{"prompt_token_ids": [1' + "0" * 5000 + "]}"),
    )
)
def test_prompts_files(content: Any, model_dir: Path, root: Path, stand_ins) -> None:
    path = _write(root / "prompts.jsonl", content)
    argv = ["run", "--model-path", str(model_dir), "--prompts-file", str(path), "--max-tokens", "8"]
    got = check("prompts file", [*argv, "--json"])
    if isinstance(got, Reached):
        _, _, requests, _ = got.kwargs["args"]
        for r in requests:
            assert r.prompt_token_ids and all(0 <= t < 512 for t in r.prompt_token_ids)
            assert r.max_new_tokens >= 1 and len(r.prompt_token_ids) + r.max_new_tokens <= 512


@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_tokenizer_files(data: st.DataObject, model_dir: Path, root: Path, stand_ins) -> None:
    folder = _fresh(root, "tok-model", like=model_dir)
    real = json.loads((model_dir / "tokenizer.json").read_text())
    content = data.draw(mutated(real) | st.binary(max_size=40))
    _write(folder / "tokenizer.json", content)
    argv = ["run", "--model-path", str(folder), "--prompt", "t5 t6 t7", "--max-tokens", "2"]
    check("tokenizer file", argv)
