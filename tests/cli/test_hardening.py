"""The bad inputs issue 17 lists, each by name: the one-line error a user gets (exit 2), or
the refusal of a value that used to be accepted. The fuzz tests (test_fuzz.py) cover the same
ground at random; these pin the messages."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fuzzing import invoke, one_line_error
from tests.helpers import IMAGE, TINY_LLAMA


@pytest.fixture
def tiny(write_config) -> Path:
    return write_config(TINY_LLAMA, "tiny")  # max_position_embeddings 4096


EST = ["estimate", "qwen3-32b", "--gpu", "h100"]
PLAN = ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*EST, "--context", "infK"], "is not a token count"),
        ([*EST, "--context", "nan"], "is not a token count"),
        ([*EST, "--context", "9" * 400], "is not a token count"),
        # ASCII digits only, a decimal part only before a unit (int() takes all of these)
        ([*EST, "--context", "\u0663\u0662K"], "--context '\u0663\u0662K' is not a token count"),
        ([*EST, "--context", "32 K"], "is not a token count"),
        ([*EST, "--context", "1_000"], "is not a token count"),
        ([*EST, "--context", "1e1K"], "is not a token count"),
        ([*EST, "--context", "8.5"], "is not a token count"),
        ([*EST, "--isl", "0", "--osl", "1K", "--concurrency", "1"], "--isl '0' must be at least 1"),
        ([*EST, "--isl", "1K", "--osl", "-1", "--concurrency", "1"], "--osl '-1' is not a token"),
        ([*PLAN, "--tpot-slo-ms", "\u0665\u0660"], "--tpot-slo-ms takes positive numbers of ms"),
        # not the memory: the count asked for (each owner holds a request per microbatch)
        (
            [
                *("plan", "llama-3.3-70b", "--gpus", "h100", "--context", "128K"),
                *("--tpot-slo-ms", "200", "--microbatches", "64"),
            ],
            "at context 131072 with 64 microbatches: no owner configuration holds its weights "
            "and the state of 64 requests; lower --microbatches",
        ),
        ([*PLAN, "--tpot-slo-ms", "50", "--microbatches", "65"], "counts from 1 to 64, got '65'"),
        ([*EST, "--context", "99999999999K"], "is more than 2147483648 tokens"),
        ([*EST, "--batch", "9" * 400], "--batch"),
        ([*EST, "--context", "64K"], "beyond qwen3-32b's context of 40960 tokens"),
        (["analyze", "qwen3-32b", "--gpus", "h100", "--contexts", "128K"], "beyond qwen3-32b"),
        (["analyze", "qwen3-32b", "--gpus", "h100", "--tp", "3"], "--tp must be one of"),
        (["analyze", "qwen3-32b", "--gpus", "h100", "--plot", "a.gif"], "unsupported file type"),
        (
            ["plan", "qwen3-32b", "--gpus", "h100", "--context", "64K", "--tpot-slo-ms", "50"],
            "beyond qwen3-32b",
        ),
        (
            ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "inf"],
            "--tpot-slo-ms takes positive numbers",
        ),
        (
            ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "nan"],
            "--tpot-slo-ms takes positive numbers",
        ),
    ],
)
def test_numbers_beyond_reason(args: list[str], message: str) -> None:
    assert message in one_line_error(args)


def test_plot_paths(tmp_path: Path) -> None:
    base = ["analyze", "qwen3-32b", "--gpus", "h100", "--contexts", "8K", "--plot"]
    assert "is a directory" in one_line_error([*base, str(tmp_path)])
    assert "unsupported file type '.txt'" in one_line_error([*base, str(tmp_path / "a.txt")])
    assert "unsupported file type '(none)'" in one_line_error([*base, str(tmp_path / "plot")])
    assert "does not exist" in one_line_error([*base, str(tmp_path / "no" / "such" / "a.png")])
    # a pipe nobody reads would hold the command forever (plan -o blocked until killed)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    assert "is not a regular file (a pipe or socket)" in one_line_error([*base, str(fifo)])
    plan = ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50"]
    assert "-o " + str(fifo) + " is not a regular file" in one_line_error([*plan, "-o", str(fifo)])


def test_a_link_to_nothing_is_named_as_one(tmp_path: Path) -> None:
    """A symlink loop or a dangling link read 'does not exist' although the name is there."""
    loop, back, dangling = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    loop.symlink_to(back)
    back.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone.json")
    for path in (loop, dangling):
        assert one_line_error(["simulate", str(path)]).endswith(
            f"plan file {path} is a symbolic link to nothing (dangling, or a loop); give the "
            "file itself"
        )
    linked = "is a symbolic link to nothing (dangling, or a loop); give the file itself"
    assert one_line_error(["estimate", str(loop), "--gpu", "h100"]).endswith(linked)
    # a workload file, and a model folder whose config.json lost its blob (a hub cache)
    workload = ["estimate", "qwen3-8b", "--gpu", "h100", "--workload", str(dangling)]
    assert one_line_error(workload).endswith(f"workload file {dangling} {linked}")
    folder = tmp_path / "snapshot"
    folder.mkdir()
    (folder / "config.json").symlink_to(tmp_path / "blobs" / "0123")
    assert one_line_error(["estimate", str(folder), "--gpu", "h100"]).endswith(linked)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unreadable_and_unwritable_paths_exit_2(tmp_path: Path, tiny: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        base = ["plan", str(tiny), "--gpus", "h100", "--context", "256", "--tpot-slo-ms", "50"]
        assert "not writable" in one_line_error([*base, "-o", str(locked / "p.json")])
        secret = tmp_path / "secret.json"
        secret.write_text("{}")
        secret.chmod(0)
        assert "Permission denied" in one_line_error(["simulate", str(secret)])
        (tiny / "config.json").chmod(0)
        assert "Permission denied" in one_line_error(["estimate", str(tiny), "--gpu", "h100"])
    finally:
        locked.chmod(0o700)


def test_a_file_the_system_will_not_let_anyone_write_exits_2(tiny: Path) -> None:
    """/proc takes no new files, not even from root (whose writes os.access cannot foresee)."""
    base = ["plan", str(tiny), "--gpus", "h100", "--context", "256", "--tpot-slo-ms", "50"]
    line = one_line_error([*base, "-o", "/proc/opweave-plan.json"])
    assert "/proc/opweave-plan.json" in line


def test_simulate_never_opens_the_plans_model_name_as_a_path(tmp_path: Path, tiny: Path) -> None:
    """A plan file is data: its model name (here a path) must not lead the CLI to read files."""
    from opweave.costmodel import canonical_plan, load_model

    plan = canonical_plan(load_model(tiny), "colocated", gpu="h100", batch=4)
    doc = json.loads(plan.model_dump_json())
    doc["model"]["name"] = str(tiny)  # a plan someone crafted to point at a file
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    assert "is not built in; pass --model" in one_line_error(["simulate", str(path)])
    code, out, err, _ = invoke(["simulate", str(path), "--model", str(tiny), "--json"])
    assert code == 0, err
    assert json.loads(out)["tpot_s"] > 0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("model", "num_layers", -1), "model.num_layers: Input should be greater than or equal"),
        (("model", "num_layers", 3), "records num_layers 3, the config's 2 beside this config"),
        (("model", "family", "qwen3"), "records family qwen3, the config's llama"),
        (("prediction", "tpot_s", -1.0), "prediction.tpot_s: Input should be greater than 0"),
        (("prediction", "usd_per_million_tokens", -5.0), "prediction.usd_per_million_tokens"),
        (("microbatches", None, 1), "microbatches: given twice; keep one"),
        # deploy writes the name into shell scripts: a newline would end their comment
        (("model", "name", "x\ntouch /tmp/owned\n#"), "model.name: String should match"),
        (("model", "family", "bogus"), "'bogus' is not a supported family"),
        # simulate costed an unknown format as the checkpoint's own
        (("model", "quant", "bogus"), "model.quant: 'bogus' is not a weight format"),
        (("model", "quant", "fp8+bf16"), "join distinct formats in sorted order"),
        (("model", "config_sha256", "zz"), "model.config_sha256: String should match pattern"),
        # the precision alone edited: the fingerprint is the checkpoint's own
        (
            ("model", "quant", "fp8"),
            "records fp8 weights and a fp32 KV cache beside the fingerprint",
        ),
        # each microbatch is simulated: a thousand took a minute
        (("microbatches", 1000, None), "microbatches: Input should be less than or equal to 64"),
    ],
)
def test_an_edited_plan_file(tmp_path: Path, tiny: Path, edit: tuple, message: str) -> None:
    """A plan whose recorded model or prediction was edited by hand, or that names a key twice
    (the JSON parser would keep the last), is refused, not simulated."""
    from opweave.costmodel import canonical_plan, load_model

    plan = canonical_plan(load_model(tiny), "colocated", gpu="h100", batch=4)
    doc = json.loads(plan.model_dump_json())
    section, key, value = edit
    if key is None:  # the key twice: prepend a second copy
        text = json.dumps(doc).replace("{", f'{{"{section}": {value}, ', 1)
    elif value is None:  # a top-level value
        doc[section] = key
        text = json.dumps(doc)
    else:
        if doc[section] is None:  # a canonical plan predicts nothing: give it a prediction
            doc[section] = {"tpot_s": 0.02, "stages_per_token": 1}
        doc[section][key] = value
        text = json.dumps(doc)
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert message in one_line_error(["simulate", str(path), "--model", str(tiny)])


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ('id = "h100"\nusd_per_hour = -1.0', "usd_per_hour"),
        ('id = "h100"\nusd_per_hour = 0.0', "usd_per_hour"),
        ('id = "h100"\nusd_per_hour = nan', "usd_per_hour"),
        ('id = "h100"\nusd_per_hour = inf', "usd_per_hour"),
        ('id = "h100"\nmem_bandwidth_bytes_per_s = inf', "mem_bandwidth_bytes_per_s"),
        ('id = "h100"\nmemory_bytes = 0', "memory_bytes"),
        # a rate so small that a step's time overflows to inf (and the simulator to nan)
        ('id = "h100"\nmem_bandwidth_bytes_per_s = 1e-300', "greater than or equal to 1000000"),
        ('id = "h100"\ndense_flops_per_s = 1e-300', "dense_flops_per_s"),
        ('id = "h100"\nnetwork_bandwidth_bytes_per_s = 1e-300', "network_bandwidth"),
        ('id = "h100"\ncompute_efficiency = 1e-300', "compute_efficiency"),
        ('id = "h100"\nside_streams = "yes"', "side_streams"),
        ('id = "h100"\naliases = ["x", "x"]', "alias 'x' is listed twice"),
        ('id = "h100"\nnetwork_latency_s = nan', "network_latency_s"),
        ('id = ""\nusd_per_hour = 1.0', "'id' must be a non-empty string"),
        ('id = "h100"\nusd_per_hour = 1.0\n[[gpus]]\nid = "H100-SXM"', "is given twice"),
        ("id = 7\nusd_per_hour = 1.0", "'id' must be a non-empty string"),
        ('id = "b300"\nfp8_flops_per_s = -1.0', "fp8_flops_per_s"),
        ('id = "b300"\nfp4_flops_per_s = nan', "fp4_flops_per_s"),
        ('id = "b300"\nfp4_flops_per_s = "9e15"', "fp4_flops_per_s"),
        ('id = "b300"\nfp8_compute_efficiency = 1.5', "fp8_compute_efficiency"),
        ('id = "b300"\nfp4_compute_efficiency = 0.0', "fp4_compute_efficiency"),
        ('id = "gb200"\nnvlink_domain_gpus = 0', "nvlink_domain_gpus"),
        ('id = "gb200"\nnvlink_domain_gpus = 72.0', "nvlink_domain_gpus"),
        # rules across fields name both
        (
            'id = "a100"\nfp8_compute_efficiency = 0.7',
            "fp8_compute_efficiency needs fp8_flops_per_s",
        ),
        (
            'id = "h100"\nfp4_compute_efficiency = 0.7',
            "fp4_compute_efficiency needs fp4_flops_per_s",
        ),
        (
            'id = "gb200"\nnvlink_domain_gpus = 6',
            "nvlink_domain_gpus (6) must be a multiple of gpus_per_node (4)",
        ),
        (
            'id = "gb300"\ngpus_per_node = 8\nnvlink_domain_gpus = 36',
            "nvlink_domain_gpus (36) must be a multiple of gpus_per_node (8)",
        ),
    ],
)
def test_hardware_file_values(tmp_path: Path, entries: str, message: str) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(f"schema_version = 1\n[[gpus]]\n{entries}\n")
    assert message in one_line_error(["gpus", "--hardware", str(path)])


def test_a_hardware_file_sets_the_fp8_fp4_rates_and_the_nvlink_domain(tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(
        '[[gpus]]\nid = "b300"\nfp4_flops_per_s = 1.35e16\nfp4_compute_efficiency = 0.7\n'
        '[[gpus]]\nid = "a100"\nfp8_flops_per_s = 6.24e14\n'
        '[[gpus]]\nid = "gb200"\nnvlink_domain_gpus = 36\n'
        '[[gpus]]\nid = "rack"\nmemory_bytes = 1e11\nmem_bandwidth_bytes_per_s = 4e12\n'
        "dense_flops_per_s = 1e15\nfp8_flops_per_s = 2e15\n"
        "intra_node_bandwidth_bytes_per_s = 9e11\nnetwork_bandwidth_bytes_per_s = 5e10\n"
        "gpus_per_node = 4\nnvlink_domain_gpus = 16\n"
    )
    code, out, err, _ = invoke(["gpus", "--hardware", str(path), "--json"])
    assert code == 0, err
    gpus = {g["id"]: g for g in json.loads(out)["gpus"]}
    b300 = gpus["b300"]
    assert (b300["fp4_flops_per_s"], b300["fp4_compute_efficiency"]) == (1.35e16, 0.7)
    assert b300["fp8_flops_per_s"] == 4.5e15  # the fields not named keep the catalog's
    assert gpus["a100-sxm-80gb"]["fp8_flops_per_s"] == 6.24e14
    assert (gpus["gb200"]["nvlink_domain_gpus"], gpus["gb200"]["gpus_per_node"]) == (36, 4)
    rack = gpus["rack"]
    assert (rack["fp8_flops_per_s"], rack["fp4_flops_per_s"], rack["nvlink_domain_gpus"]) == (
        2e15,
        None,
        16,
    )


def test_a_new_gpu_is_found_by_any_case(tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    fields = {
        "memory_bytes": 96e9,
        "mem_bandwidth_bytes_per_s": 4e12,
        "dense_flops_per_s": 8e14,
        "intra_node_bandwidth_bytes_per_s": 4e11,
        "network_bandwidth_bytes_per_s": 5e10,
        "usd_per_hour": 3.0,
    }
    path.write_text(
        '[[gpus]]\nid = "My-Accel"\n' + "".join(f"{k} = {v!r}\n" for k, v in fields.items())
    )
    code, _, err, _ = invoke(
        ["estimate", "qwen3-32b", "--gpu", "my-accel", "--hardware", str(path)]
    )
    assert code == 0, err


def test_profile_flags_refused_before_any_timing(tmp_path: Path, tiny: Path) -> None:
    base = ["profile", "-m", str(tiny), "-o", str(tmp_path / "p.json")]
    for value in ("inf", "nan", "0", "-1"):
        assert "--usd-per-hour" in one_line_error([*base, "--usd-per-hour", value])
    assert "--working-set-mib" in one_line_error([*base, "--working-set-mib", "nan"])
    assert "beyond tiny's context of 4096" in one_line_error([*base, "--contexts", "8K"])
    assert "--tp takes degrees" in one_line_error([*base, "--tp", "3"])
    assert "is a directory" in one_line_error(["profile", "-m", str(tiny), "-o", str(tmp_path)])
    # an option the other way of profiling reads is refused, not ignored
    line = one_line_error([*base, "--hardware", str(tmp_path / "none.toml"), "--engine", "sglang"])
    assert "--engine and --hardware apply to --from aiconfigurator" in line
    imported = ["profile", "-m", "qwen3-32b", "--from", "aiconfigurator", "--device", "h100"]
    line = one_line_error([*imported, "-o", str(tmp_path / "p.json"), "--repeats", "3"])
    assert "--repeats sets how a profile is measured" in line


def test_a_profile_with_duplicate_tables_or_devices(tmp_path: Path, tiny: Path) -> None:
    from opweave.costmodel import default_catalog, load_model, synthesize_profile

    spec = load_model(tiny)
    profile = synthesize_profile(spec, default_catalog().get("l4"), batches=(1, 4))
    doc = json.loads(profile.model_dump_json())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    plan = ["plan", str(tiny), "--gpus", "l4", "--context", "256", "--tpot-slo-ms", "50"]
    assert "two profiles are for device l4" in one_line_error(
        [*plan, "--profile", str(path), "--profile", str(path)]
    )
    doc["ops"].append(doc["ops"][0])
    path.write_text(json.dumps(doc))
    assert "two tables for" in one_line_error([*plan, "--profile", str(path)])
    doc["ops"].pop()
    doc["device"]["usd_per_hour"] = float("inf")
    path.write_text(json.dumps(doc).replace("Infinity", "1e999"))
    assert "usd_per_hour" in one_line_error([*plan, "--profile", str(path)])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"layer_types": 3}, "layer_types: expected a list of strings"),
        ({"layer_types": [["full_attention"], "full_attention"]}, "layer_types: expected a list"),
        ({"quantization_config": "fp8"}, "quantization_config: expected an object"),
        ({"num_hidden_layers": 10**7}, "num_hidden_layers: 10000000 is out of range"),
        ({"hidden_size": 1e40}, "hidden_size"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: expected a finite positive number"),
        ({"rope_theta": float("inf")}, "rope_theta: expected a finite positive number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 1.0}},
            "must exceed low_freq_factor",
        ),
        ({"eos_token_id": 100}, "eos_token_id: 100 is outside the vocabulary"),
        ({"torch_dtype": {"x": 1}}, "dtype:"),
        (
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "bogus"}},
            "quantization_config.activation_scheme 'bogus': use static or dynamic",
        ),
        (  # MXFP4 quantises routed experts only, and this model has none
            {"quantization_config": {"quant_method": "mxfp4"}},
            "mxfp4 quantises routed experts only",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["re:[("]}},
            "module pattern 're:[(' is not a valid regular expression",
        ),
        (  # Python's matcher would backtrack for ever on a name it does not match
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "modules_to_not_convert": ["re:(.*)*x$"],
                }
            },
            "repeats a group that itself repeats",
        ),
        # transformers' AutoConfig (what engines load configs with) knows no such type
        ({"model_type": 5}, "model_type: expected a model type's name (letters, digits, _ . -)"),
        ({"model_type": ""}, "model_type: expected a model type's name"),
        ({"model_type": "llama\u200b"}, "model_type: expected a model type's name"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope_type 'yarn' needs a factor"),
        (
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"g": {"targets": ["Linear"], "weights": None}},
                }
            },
            "no group quantises weights (each group's weights is null)",
        ),
        (
            {"rope_scaling": {"rope_type": "bogus", "factor": 4.0}},
            "rope_scaling.rope_type (full_attention layers): rope_type 'bogus' is none that "
            "transformers or vLLM know",
        ),
    ],
)
def test_config_fields(write_config, edit: dict, message: str) -> None:
    folder = write_config({**TINY_LLAMA, **edit}, "edited")
    line = one_line_error(["estimate", str(folder), "--gpu", "h100"])
    assert line.startswith(f"error: {folder / 'config.json'}: ") and message in line, line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"isl": 100, "isl": 200, "osl": 200, "concurrency": 4}', "gives 'isl' twice"),
        ('{"isl": 100, "osl": 200, "concurrency": true}', "concurrency: Input should be"),
        ('{"isl": 100, "osl": 200, "concurrency": 4.0}', "concurrency: Input should be"),
        ('{"isl": 100, "osl": 200, "rate_per_s": "2"}', "rate_per_s: Input should be"),
        ('{"isl": 100, "osl": 200, "rate_per_s": 2, "memory_fraction": true}', "memory_fraction"),
        (
            '{"isl": {"kind": "uniform", "high_tokens": 3000}, "osl": 200, "concurrency": 4}',
            "isl: a uniform length needs integer low_tokens and high_tokens",
        ),
        (
            '{"isl": {"kind": "uniform", "tokens": 5, "low_tokens": 10, "high_tokens": 30}, '
            '"osl": 200, "concurrency": 4}',
            "isl: tokens 5 is not the mean of low_tokens and high_tokens (20)",
        ),
        (
            '{"schema_version": "1", "isl": 100, "osl": 200, "concurrency": 4}',
            'schema_version must be the integer 1, not the string "1"; write "schema_version": 1',
        ),
    ],
)
def test_workload_file_values(tmp_path: Path, text: str, message: str) -> None:
    """A workload file's values as they are written: no true for 1, no "2" for 2, no key
    given twice (json.loads would keep the last)."""
    path = tmp_path / "w.json"
    path.write_text(text)
    assert message in one_line_error([*EST, "--workload", str(path)])


def test_an_slo_in_exponent_notation_is_the_number_it_spells() -> None:
    results = []
    for slo in ("50", "5e1", "0.5E2", "50.0"):
        code, out, err, _ = invoke([*PLAN, "--tpot-slo-ms", slo, "--json"])
        assert code == 0, err
        results.append(json.loads(out)["best"])
    assert all(r == results[0] for r in results)


def test_a_workload_file_may_carry_its_schema_version(tmp_path: Path) -> None:
    """As OpWeave's other files do: the same estimate with or without it."""
    path = tmp_path / "w.toml"
    path.write_text("isl = 1000\nosl = 200\nconcurrency = 4\n")
    code, plain, err, _ = invoke([*EST, "--workload", str(path), "--json"])
    assert code == 0, err
    path.write_text("schema_version = 1\nisl = 1000\nosl = 200\nconcurrency = 4\n")
    code, versioned, err, _ = invoke([*EST, "--workload", str(path), "--json"])
    assert code == 0, err
    assert json.loads(versioned) == json.loads(plain)


def test_work_and_files_a_plan_is_asked_for(tmp_path: Path) -> None:
    base = PLAN
    slos = ",".join(str(n) for n in range(1, 66))
    assert "gives 65 SLOs; give at most 64" in one_line_error([*base, "--tpot-slo-ms", slos])
    same = str(tmp_path / "x.png")
    line = one_line_error([*base, "--tpot-slo-ms", "50", "-o", same, "--plot", same])
    assert "-o and --plot both name" in line
    empty = tmp_path / "hw.toml"
    empty.write_text("schema_version = 1\ngpus = []\n")
    line = one_line_error(["gpus", "--hardware", str(empty)])
    assert "needs a list 'gpus' of GPU entries" in line


def test_a_config_naming_a_key_twice(write_config, tmp_path: Path) -> None:
    folder = write_config(TINY_LLAMA, "dup")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace("{", '{"hidden_size": 4, ', 1))
    assert "gives 'hidden_size' twice; keep one" in one_line_error(
        ["estimate", str(folder), "--gpu", "h100"]
    )


def test_config_nesting_and_odd_json(write_config, tmp_path: Path) -> None:
    folder = write_config({"model_type": "gemma3", "text_config": [1]}, "gemma")
    assert "text_config: expected an object" in one_line_error(
        ["estimate", str(folder), "--gpu", "h100"]
    )
    moe = {"model_type": "qwen3_moe", **{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}}
    folder = write_config({**moe, "num_experts": 4, "num_experts_per_tok": 5}, "moe")
    assert "num_experts_per_tok: 5 is more than the 4 experts" in one_line_error(
        ["estimate", str(folder), "--gpu", "h100"]
    )
    folder = tmp_path / "deep"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nests JSON too deeply" in one_line_error(["estimate", str(folder), "--gpu", "h100"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["plan", "qwen3-32b", "--gpus", "h100,,a100", "--tpot-slo-ms", "50", "--context", "1K"],
            "has an empty item",
        ),
        (
            ["plan", "qwen3-32b", "--gpus", "h100", "--tpot-slo-ms", "50,", "--context", "1K"],
            "has an empty item",
        ),
        (["analyze", "qwen3-32b", "--gpus", "h100", "--contexts", "1K,1024"], "more than once"),
        (
            [
                "plan",
                "qwen3-32b",
                "--gpus",
                "h100",
                "--tpot-slo-ms",
                "50",
                "--microbatches",
                "2,2",
                "--context",
                "1K",
            ],
            "--microbatches '2,2' names 2 more than once",
        ),
        (
            [
                "plan",
                "qwen3-32b",
                "--gpus",
                "h100",
                "--gpus",
                "a100",
                "--tpot-slo-ms",
                "50",
                "--context",
                "1K",
            ],
            "--gpus is given more than once",
        ),
        (["estimate", "qwen3-32b", "--gpu", "h100", "--batch", "2", "--batch=3"], "--batch is"),
        (["estimate", "", "--gpu", "h100"], "an argument is empty"),
        (["estimate", "qwen3-32b", "--gpu="], "--gpu is empty"),
        (
            [
                "plan",
                "qwen3-32b",
                "--gpus",
                "h100:99999999999999999999",
                "--tpot-slo-ms",
                "50",
                "--context",
                "1K",
            ],
            "at most 100,000 GPUs of one type",
        ),
    ],
)
def test_what_click_would_take_silently(args: list[str], message: str) -> None:
    assert message in one_line_error(args)


def test_estimate_refuses_a_degree_the_model_does_not_split_over(write_config) -> None:
    config = write_config({**TINY_LLAMA, "num_attention_heads": 12, "num_key_value_heads": 4})
    for command in (["estimate", str(config), "--gpu", "h100"], ["analyze", str(config)]):
        flag = ["--gpus", "h100"] if command[0] == "analyze" else []
        assert "does not split over tp 8" in one_line_error([*command, *flag, "--tp", "8"])


def test_a_hardware_file_cannot_take_another_gpus_alias_or_an_unlistable_id(
    tmp_path: Path,
) -> None:
    steal = tmp_path / "steal.toml"
    steal.write_text('[[gpus]]\nid = "h100"\naliases = ["a100"]\n')
    assert "alias 'a100' already names a100-sxm-80gb" in one_line_error(
        ["estimate", "qwen3-32b", "--gpu", "a100", "--hardware", str(steal)]
    )
    odd = tmp_path / "odd.toml"
    odd.write_text('[[gpus]]\nid = "my gpu,x:3"\nmemory_bytes = 1e10\n')
    assert "may hold only letters, digits" in one_line_error(["gpus", "--hardware", str(odd)])
    small = tmp_path / "small.toml"
    small.write_text('[[gpus]]\nid = "h100"\ngpus_per_node = 2\n')
    assert "h100-sxm has 2 GPUs per NVLink domain" in one_line_error(
        ["estimate", "qwen3-32b", "--gpu", "h100", "--tp", "4", "--hardware", str(small)]
    )
    version = tmp_path / "version.toml"
    version.write_text('schema_version = true\n[[gpus]]\nid = "h100"\n')
    assert "schema_version" in one_line_error(["gpus", "--hardware", str(version)])


def test_deploy_refuses_what_kubernetes_would_and_leaves_no_stale_node_groups(
    tmp_path: Path,
) -> None:
    plan = tmp_path / "p.json"
    args = ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50", "-o"]
    code, _, err, _ = invoke([*args, str(plan)])
    assert code == 0, err
    out = tmp_path / "d"
    for flag, value in (
        ("--namespace", "Bad NS"),
        ("--model-pvc", "x y"),
        ("--node-selector-key", "bad key!"),
    ):
        assert flag in one_line_error(["deploy", str(plan), "-o", str(out), *IMAGE, flag, value])
    (out / "k8s").mkdir(parents=True)
    (out / "launch").mkdir()
    (out / "k8s" / "node-group-5.yaml").write_text("old")
    (out / "launch" / "node-5.sh").write_text("old")
    code, _, err, _ = invoke(["deploy", str(plan), "-o", str(out), *IMAGE])
    assert code == 0, err
    assert not (out / "k8s" / "node-group-5.yaml").exists()
    assert not (out / "launch" / "node-5.sh").exists()
    assert (out / "k8s" / "node-group-0.yaml").exists()
    assert (out / "k8s" / "secret.yaml").stat().st_mode & 0o077 == 0


def test_a_deployment_refuses_a_model_name_that_would_break_its_scripts(tmp_path: Path) -> None:
    from opweave.costmodel import canonical_plan, load_model

    doc = json.loads(canonical_plan(load_model("qwen3-8b"), "colocated", gpu="h100", batch=4)
                     .model_dump_json())  # fmt: skip
    doc["model"]["name"] = "qwen3-8b\ntouch /tmp/owned\n#"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    line = one_line_error(["deploy", str(path), *IMAGE, "-o", str(tmp_path / "d")])
    assert "model.name" in line and not (tmp_path / "d").exists()
    folder = tmp_path / "evil\ntouch x\n#"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert "holds control characters" in one_line_error(["estimate", str(folder), "--gpu", "h100"])


def test_latencies_and_prices_beyond_reason_are_refused(tmp_path: Path, tiny: Path) -> None:
    from opweave.costmodel import Profile

    prof = tmp_path / "p.json"
    assert invoke(["profile", "--model", str(tiny), "--device", "cpu", "--batches", "1",
                   "--contexts", "8", "--no-transfer", "--no-orchestration", "--no-idle",
                   "-o", str(prof), "-q"])[0] == 0  # fmt: skip
    doc = json.loads(prof.read_text())
    doc["ops"][0]["latency_s"] = [[1e-300]]
    prof.write_text(json.dumps(doc))
    assert "latencies must be seconds from 1e-9" in one_line_error(
        ["estimate", str(tiny), "--gpu", "cpu", "--profile", str(prof)]
    )
    with pytest.raises(ValueError):
        Profile.model_validate(doc)
    hw = tmp_path / "hw.toml"
    hw.write_text('[[gpus]]\nid = "h100"\nusd_per_hour = 1e-300\n')
    assert "usd_per_hour" in one_line_error(["gpus", "--hardware", str(hw)])


def test_a_closed_stdout_is_one_line_on_stderr() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "opweave.cli", "models"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: os.close(1), check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: standard output is closed; run with it open"


def test_a_plans_strategy_and_its_owners_agree(tmp_path: Path, tiny: Path) -> None:
    """A plan labelled colocated with three owners was simulated as a pipeline under that
    label; AFD and CAD have two owners."""
    from opweave.costmodel import canonical_plan, load_model

    plan = canonical_plan(load_model(tiny), "colocated", gpu="h100", batch=4)
    doc = json.loads(plan.model_dump_json())
    doc["owners"] *= 3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    line = one_line_error(["simulate", str(path), "--model", str(tiny)])
    assert "colocated plans have 1 owner, this one 3; label a plan of other owners opweave" in line
    doc = json.loads(canonical_plan(load_model(tiny), "afd", gpu="h100", batch=4).model_dump_json())
    doc["owners"] = doc["owners"][:1]
    path.write_text(json.dumps(doc))
    line = one_line_error(["simulate", str(path), "--model", str(tiny)])
    assert "afd plans have 2 owners, this one 1" in line, line


def test_a_quantisation_config_that_is_not_a_file(tiny: Path) -> None:
    """An hf_quant_config.json that is a folder was passed over: the model was costed as
    unquantised."""
    (tiny / "hf_quant_config.json").mkdir()
    line = one_line_error(["estimate", str(tiny), "--gpu", "h100"])
    assert line == (
        f"error: {tiny / 'hf_quant_config.json'} is not a readable file; ModelOpt's "
        "quantisation config must be its JSON file (remove it if the checkpoint is not "
        "quantised)"
    )


def test_deploy_refuses_a_plan_that_cannot_run(tmp_path: Path) -> None:
    """An edited plan of a built-in model whose cut is past the block, or whose owners' GPUs
    hold less than it needs: deploy wrote its scripts; simulate refused it."""
    from opweave.costmodel import canonical_plan, load_model

    plan = canonical_plan(load_model("qwen3-32b"), "colocated", gpu="h100", batch=64, tp=8)
    good = json.loads(plan.model_dump_json())
    path, out = tmp_path / "plan.json", tmp_path / "d"
    for edit, message in (
        (lambda d: d["template"].update(cuts=[1000]), "template cut 1000 is past the block's"),
        (
            lambda d: d.update(
                context_tokens=40960, owners=[{**d["owners"][0], "resident_batch": 4096}]
            ),
            "needs ",
        ),
    ):
        doc = json.loads(json.dumps(good))
        edit(doc)
        path.write_text(json.dumps(doc))
        line = one_line_error(["deploy", str(path), *IMAGE, "-o", str(out)])
        assert message in line, line
        assert not out.exists()
    path.write_text(json.dumps(good))
    code, _, err, _ = invoke(["deploy", str(path), *IMAGE, "-o", str(out)])
    assert code == 0, err


def test_deploy_refuses_a_prefill_pool_that_does_not_split_the_model(tmp_path: Path) -> None:
    """Expert parallelism for a dense model's prefill pool: the nodes would refuse the pool
    once started; deploy refuses it before writing anything."""
    from opweave.costmodel import PrefillPool, canonical_plan, load_model

    plan = canonical_plan(load_model("qwen3-32b"), "colocated", gpu="h100", batch=64, tp=8)
    path = tmp_path / "plan.json"
    for pool, ok in (
        (PrefillPool(gpu="h100-sxm", tp=4, replicas=2), True),
        (PrefillPool(gpu="h100-sxm", tp=4, ep=2, dp=2, replicas=1), False),
    ):
        path.write_text(plan.model_copy(update={"prefill": pool}).model_dump_json())
        out = tmp_path / ("ok" if ok else "refused")
        if ok:
            code, _, err, _ = invoke(["deploy", str(path), *IMAGE, "-o", str(out)])
            assert code == 0, err
        else:
            line = one_line_error(["deploy", str(path), *IMAGE, "-o", str(out)])
            assert line == (
                "error: the plan's prefill pool (h100-sxm tp4 ep2 dp2): ep 2: qwen3-32b has no "
                "routed experts (a dense model); use ep 1"
            )
            assert not out.exists()


def test_simulate_says_why_a_plans_prediction_may_differ(tmp_path: Path) -> None:
    """A decode-only plan edited by hand: the note named only a workload's prefill as the cause
    of the difference; it names both, and the two figures."""
    path = tmp_path / "p.json"
    code, _, err, _ = invoke([*PLAN, "--tpot-slo-ms", "50", "-o", str(path)])
    assert code == 0, err
    doc = json.loads(path.read_text())
    doc["microbatches"] = 3
    path.write_text(json.dumps(doc))
    code, _, err, _ = invoke(["simulate", str(path)])
    assert code == 0, err
    planned = doc["prediction"]["tpot_s"] * 1e3
    assert err.startswith(f"note: the plan file predicts TPOT {planned:.3f} ms and $"), err
    assert err.rstrip().endswith(
        "the plan was made for a workload (its prediction covers the whole deployment, prompts "
        "prefilled beside decode), or the file was edited since"
    ), err
    # an edited price leaves the TPOT alone and was not noted
    doc["microbatches"] = 1
    doc["hardware"][0]["usd_per_hour"] *= 10
    path.write_text(json.dumps(doc))
    code, _, err, _ = invoke(["simulate", str(path)])
    assert code == 0, err
    usd = doc["prediction"]["usd_per_million_tokens"]
    said = f"iteration {planned:.3f} ms and ${10 * usd:.4g} per million tokens: the plan"
    assert said in err, err
    # a recorded cost of 0 (the schema allows it) is compared, not divided by
    doc["prediction"]["usd_per_million_tokens"] = 0.0
    path.write_text(json.dumps(doc))
    code, _, err, _ = invoke(["simulate", str(path)])
    assert code == 0 and "and $0 per million tokens, this re-simulation" in err, err


def test_a_missing_vocab_size_is_named_where_it_shows(write_config) -> None:
    """transformers' LlamaConfig default (32000) holds no EOS id of Llama 3's vocabulary."""
    config = {k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"} | {"eos_token_id": 128001}
    folder = write_config(config, "novocab")
    assert one_line_error(["estimate", str(folder), "--gpu", "h100"]).endswith(
        "eos_token_id: 128001 is outside the vocabulary (vocab_size 32000, transformers' "
        "default: the config gives none)"
    )


def test_an_edited_owner_gpu_or_smaller_nodes_name_their_cause(tmp_path: Path) -> None:
    """An owner's GPU edited to an unknown id was reported as a stray hardware entry; a TP
    group wider than the nodes as a latency profile's gap, on a plan without a profile."""
    path = tmp_path / "p.json"
    code, _, err, _ = invoke([*PLAN, "--tpot-slo-ms", "50", "-o", str(path)])
    assert code == 0, err
    good = json.loads(path.read_text())
    assert good["owners"][0]["tp"] == 8, good["owners"]
    doc = json.loads(json.dumps(good))
    doc["owners"][0]["gpu"] = "h999"
    path.write_text(json.dumps(doc))
    assert (
        "hardware describes h100-sxm, which no owner uses, and owner 0's gpu 'h999' is none it "
        "describes: the file was edited; plan again"
    ) in one_line_error(["simulate", str(path)])
    doc = json.loads(json.dumps(good))
    doc["hardware"][0]["gpus_per_node"] = 4
    path.write_text(json.dumps(doc))
    assert one_line_error(["simulate", str(path)]) == (
        "error: plan owner 0 (h100-sxm) has tp 8, but each h100-sxm node holds 4 GPUs and a TP "
        "group spans one node; plan again for nodes of that size"
    )
