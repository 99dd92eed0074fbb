"""The one-line errors a user gets for a mis-written file say what is wrong with it, never
"has schema_version 1; reads version 1" or "model 'x', not 'x'"."""

from __future__ import annotations

import json
from pathlib import Path

from opweave.costmodel import canonical_plan, load_model
from tests.fuzzing import invoke, one_line_error


def test_hardware_file_with_a_quoted_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text('schema_version = "1"\n[[gpus]]\nid = "h100"\n')
    line = one_line_error(["gpus", "--hardware", str(path)])
    assert line == (
        f'error: hardware file {path}: schema_version must be the integer 1, not the string "1"; '
        "write schema_version = 1"
    )


def test_plan_file_with_a_quoted_schema_version(tmp_path: Path) -> None:
    plan = canonical_plan(load_model("qwen3-32b"), "colocated", gpu="h100-sxm", batch=1)
    doc = json.loads(plan.model_dump_json()) | {"schema_version": "1"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    line = one_line_error(["simulate", str(path)])
    assert 'schema_version: must be the integer 1, not the string "1"' in line
    assert 'write "schema_version": 1' in line


def test_a_folder_given_as_a_hardware_file(tmp_path: Path) -> None:
    line = one_line_error(["gpus", "--hardware", str(tmp_path)])
    assert line == f"error: hardware file {tmp_path} is a folder; give the file itself"


def test_a_model_config_file_is_named_after_itself(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    source = Path(__file__).parents[1] / "costmodel" / "checkpoints" / "qwen3-32b-fp8.json"
    (folder / "x.json").write_text(source.read_text())
    code, out, err, _ = invoke(["estimate", str(folder / "x.json"), "--gpu", "h100"])
    assert code == 0, err
    assert out.startswith("x on 1 x h100-sxm"), out.splitlines()[0]


def test_a_json_file_that_is_not_a_model_config_says_so(tmp_path: Path) -> None:
    """ModelOpt's hf_quant_config.json beside a checkpoint, given instead of its config.json."""
    path = tmp_path / "hf_quant_config.json"
    path.write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    line = one_line_error(
        ["estimate", str(path), "--gpu", "h200", "--batch", "8", "--context", "4K"]
    )
    assert line == (
        "error: the config has neither model_type nor architectures: it is not a model's "
        "config.json (give the model's config.json or its folder)"
    )
