"""Stages read only their own tensors; checkpoint layouts other than the tiny default load too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from opweave.runtime import LocalModel, StageModule, operator_sequence, write_tiny_model
from opweave.runtime._private import weights as weights_module


class _RecordingOpen:
    """Stands in for ``safetensors.safe_open`` and records every file opened and tensor read."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.tensors: list[str] = []

    def __call__(self, path, framework="pt"):
        recorder = self
        recorder.files.add(Path(path).name)
        handle = safe_open(path, framework=framework)

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                recorder.tensors.append(name)
                return handle.get_tensor(name)

        return Handle()


@pytest.fixture
def recording(monkeypatch):
    rec = _RecordingOpen()
    monkeypatch.setattr(weights_module, "safe_open", rec)
    return rec


def _tensor_bytes(model_dir: Path, names) -> int:
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in set(names) & set(f.keys()):
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


def test_layer_stage_reads_only_its_layer(tiny_model, recording):
    model_dir = tiny_model("llama")
    layer1 = [ref for ref in operator_sequence(model_dir) if ref.layer == 1]

    stage = StageModule(model_dir, layer1)

    prefix = "model.layers.1."
    assert sorted(recording.tensors) == sorted(
        prefix + s
        for s in (
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    )
    assert stage.weight_bytes == _tensor_bytes(model_dir, recording.tensors)


@pytest.mark.parametrize(
    ("family", "ref", "expected_suffixes"),
    [
        (
            "qwen3_next",
            (0, "core_attn"),
            {
                "linear_attn.conv1d.weight",
                "linear_attn.A_log",
                "linear_attn.dt_bias",
                "linear_attn.norm.weight",
            },
        ),
        ("qwen3_next", (3, "rope"), set()),
        (
            "qwen3_next",
            (3, "shared_expert"),
            {
                "mlp.shared_expert.gate_proj.weight",
                "mlp.shared_expert.up_proj.weight",
                "mlp.shared_expert.down_proj.weight",
                "mlp.shared_expert_gate.weight",
            },
        ),
        ("qwen3_moe", (1, "router"), {"mlp.gate.weight"}),
        (
            "gemma3_text",
            (2, "o_proj"),
            {"self_attn.o_proj.weight", "post_attention_layernorm.weight"},
        ),
        ("gemma3_text", (0, "ffn_norm"), {"pre_feedforward_layernorm.weight"}),
    ],
)
def test_single_operator_reads_exactly_its_tensors(
    family, ref, expected_suffixes, tiny_model, recording
):
    model_dir = tiny_model(family)
    StageModule(model_dir, [ref])
    assert set(recording.tensors) == {f"model.layers.{ref[0]}.{s}" for s in expected_suffixes}


def test_experts_stage_reads_only_expert_tensors(tiny_model, recording):
    model_dir = tiny_model("qwen3_moe")
    stage = StageModule(model_dir, [(2, "experts")])
    assert len(recording.tensors) == 8 * 3
    assert all(name.startswith("model.layers.2.mlp.experts.") for name in recording.tensors)
    assert stage.weight_bytes == _tensor_bytes(model_dir, recording.tensors)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3"])  # untied, and tied embeddings
def test_whole_model_reads_every_tensor_once(family, tiny_model, recording):
    model_dir = tiny_model(family)
    stage = StageModule.whole_model(model_dir)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        all_names = sorted(f.keys())
    assert sorted(recording.tensors) == all_names
    assert stage.weight_bytes == _tensor_bytes(model_dir, all_names)


def test_sharded_checkpoint_opens_only_needed_shards(tmp_path, recording, hf_greedy, prompts):
    model_dir = write_tiny_model("llama", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2

    StageModule(model_dir, [(1, "gate_up_proj")])

    needed = {
        index["model.layers.1.mlp.gate_proj.weight"],
        index["model.layers.1.mlp.up_proj.weight"],
    }
    assert recording.files == needed
    assert LocalModel(model_dir).generate(prompts, 8) == hf_greedy(model_dir, prompts, 8)


def test_multimodal_gemma3_layout_loads(tiny_model, tmp_path, hf_greedy, prompts):
    """Gemma 3 checkpoints wrap the text model (``model.language_model.*``, ``text_config``)."""
    text_dir = tiny_model("gemma3_text")
    mm_dir = tmp_path / "gemma3_mm"
    mm_dir.mkdir()
    tensors = load_file(text_dir / "model.safetensors")
    save_file(
        {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()},
        mm_dir / "model.safetensors",
    )
    text_config = json.loads((text_dir / "config.json").read_text())
    (mm_dir / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": text_config})
    )

    assert LocalModel(mm_dir).generate(prompts, 8) == hf_greedy(text_dir, prompts, 8)


def test_fused_expert_layout_loads(tiny_model, tmp_path, hf_greedy, prompts):
    """transformers 5's in-memory layout: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    import torch

    src = tiny_model("qwen3_moe")
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    fused = {}
    for layer in (1, 2):
        base = f"model.layers.{layer}.mlp.experts."
        fused[base + "gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [
                        tensors.pop(f"{base}{e}.gate_proj.weight"),
                        tensors.pop(f"{base}{e}.up_proj.weight"),
                    ]
                )
                for e in range(8)
            ]
        )
        fused[base + "down_proj"] = torch.stack(
            [tensors.pop(f"{base}{e}.down_proj.weight") for e in range(8)]
        )
    save_file({**tensors, **fused}, dst / "model.safetensors")

    assert LocalModel(dst).generate(prompts, 8) == hf_greedy(src, prompts, 8)


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "qwen3_moe",
        "mixtral",
        "gemma3_text",
        "qwen3_next",
        "deepseek_v3",
        "gpt_oss",
    ],
)
def test_every_tensor_has_the_shape_its_config_implies(family, tiny_model):
    """The shapes the runtime expects agree with transformers' own layout of every family."""
    from opweave.costmodel import load_model
    from opweave.runtime import Checkpoint

    model_dir = tiny_model(family)
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            total += len(list(f.keys()))
    assert Checkpoint(model_dir).check_shapes(load_model(model_dir).arch) == total


def test_weights_of_another_shape_are_refused_naming_the_tensor(tiny_model, tmp_path):
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import CheckpointError, Cluster

    folder = tmp_path / "edited"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96  # the checkpoint's MLP is 128 wide
    (folder / "config.json").write_text(json.dumps(config))
    spec = load_model(folder)
    with pytest.raises(CheckpointError) as info:  # before any rank process starts
        Cluster(canonical_plan(spec, "colocated", gpu="cpu", batch=1), spec, folder)
    message = str(info.value)
    assert message in (
        f"{folder}: tensor 'model.layers.{layer}.mlp.{name}.weight' has shape {got}, but "
        f"config.json implies {want}; the weights and config.json are of different models"
        for layer in (0, 1)
        for name, got, want in (
            ("gate_proj", [128, 64], [96, 64]),
            ("up_proj", [128, 64], [96, 64]),
            ("down_proj", [64, 128], [64, 96]),
        )
    ), message


def test_a_broken_index_or_safetensors_file_is_one_line(tiny_model, tmp_path):
    from opweave.runtime import Checkpoint, CheckpointError

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../x"}}')
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        Checkpoint(folder)
    (folder / "model.safetensors.index.json").unlink()
    next(folder.glob("*.safetensors")).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        Checkpoint(folder)
