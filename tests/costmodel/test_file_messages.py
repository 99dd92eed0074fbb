"""Messages about the files a user hands in say what is wrong and what to write instead."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opweave.costmodel import (
    ConfigError,
    Plan,
    Profile,
    canonical_plan,
    load_hardware_file,
    load_model,
)

CHECKPOINTS = Path(__file__).parent / "checkpoints"

FIX = "write schema_version = 1"
GPU = '[[gpus]]\nid = "h100"\nusd_per_hour = 2.0\n'


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ('"1"', 'schema_version must be the integer 1, not the string "1"; ' + FIX),
        ("1.0", "schema_version must be the integer 1, not the number 1.0; " + FIX),
        ("true", "schema_version must be the integer 1, not true; " + FIX),
        (
            "2",
            "schema_version 2 is newer than this OpWeave reads (1): upgrade OpWeave, or "
            "rewrite the file for version 1",
        ),
        ("0", "schema_version 0 is not a version OpWeave writes; write schema_version = 1"),
    ],
)
def test_hardware_schema_version(tmp_path, version: str, message: str) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(f"schema_version = {version}\n{GPU}")
    with pytest.raises(ConfigError) as info:
        load_hardware_file(path)
    assert str(info.value) == f"hardware file {path}: {message}"
    assert "reads version 1" not in str(info.value)


def test_hardware_schema_version_in_json_is_written_as_json(tmp_path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"schema_version": "1", "gpus": [{"id": "h100"}]}))
    with pytest.raises(ConfigError, match='write "schema_version": 1$'):
        load_hardware_file(path)
    path.write_text(json.dumps({"schema_version": 1, "gpus": [{"id": "h100"}]}))
    assert load_hardware_file(path).get("h100").id == "h100-sxm"


def _plan_doc() -> dict:
    model = load_model("qwen3-32b")
    return json.loads(canonical_plan(model, "colocated", gpu="h100-sxm", batch=1).model_dump_json())


@pytest.mark.parametrize("schema", [Plan, Profile])
def test_plan_and_profile_schema_version(schema) -> None:
    doc = _plan_doc() if schema is Plan else {}
    doc["schema_version"] = "1"
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError
        schema.model_validate_json(json.dumps(doc), strict=True)
    first = info.value.errors()[0]
    assert first["loc"] == ("schema_version",)
    assert first["msg"] == 'must be the integer 1, not the string "1"; write "schema_version": 1'
    doc["schema_version"] = 7
    with pytest.raises(ValueError) as info:
        schema.model_validate_json(json.dumps(doc), strict=True)
    assert info.value.errors()[0]["msg"].startswith("7 is newer than this OpWeave reads (1)")


def test_a_valid_plan_still_loads() -> None:
    doc = _plan_doc()
    assert Plan.model_validate_json(json.dumps(doc), strict=True).schema_version == 1


def test_a_folder_given_for_a_data_file_says_so(tmp_path) -> None:
    with pytest.raises(ConfigError, match="is a folder; give the file itself"):
        load_hardware_file(tmp_path)


def test_a_model_is_named_after_its_config_file_or_folder(tmp_path) -> None:
    """A config.json or a checkpoint folder is named by its folder; another .json file by its
    stem (``models/x.json`` is ``x``, not ``models``)."""
    source = CHECKPOINTS / "qwen3-32b-fp8.json"
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(source, folder / "x.json")
    assert load_model(folder / "x.json").name == "x"
    checkpoint = tmp_path / "My-Model"
    checkpoint.mkdir()
    shutil.copy(source, checkpoint / "config.json")
    assert load_model(checkpoint / "config.json").name == "My-Model"
    assert load_model(checkpoint).name == "My-Model"
    assert load_model(str(checkpoint) + "/").name == "My-Model"
