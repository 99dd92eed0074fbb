"""Quantised tiny checkpoints for tests, quantised and dequantised by the tests' own code.

The quantisers and dequantisers are written from the formats' definitions (DeepSeek-V3's block
FP8 with ``weight_scale_inv``; per-tensor FP8 with ``weight_scale``; OCP Microscaling MXFP4:
E2M1 pairs, low nibble first, an E8M0 scale per 32 values), independently of the runtime's
reader; :func:`quantised_pair` writes a quantised folder and an oracle folder holding the same
weights dequantised, for transformers to run.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_fp8(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, float32 scale per rows x cols block)``, DeepSeek-V3's layout."""
    r, c = w.shape
    nr, nc = math.ceil(r / rows), math.ceil(c / cols)
    padded = torch.zeros(nr * rows, nc * cols)
    padded[:r, :c] = w.float()
    blocks = padded.view(nr, rows, nc, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * rows, nc * cols)[:r, :c].contiguous(), scale


def block_fp8_values(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = q.shape
    out = torch.empty(r, c)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[sl] = q[sl].float() * scale[i, j]
    return out


def tensor_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().float() / FP8_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.reshape(())


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [R, C/32, 16], scales uint8 [R, C/32])``: gpt-oss's layout."""
    r, c = w.shape
    groups = w.float().view(r, c // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.floor(torch.log2(amax)) - 2  # the largest E2M1 value, 6, is 1.5 * 2^2
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    nearest = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)
    codes = nearest + 8 * (scaled < 0).long()
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (exponent + 127).to(torch.uint8)


def nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4: ``(E2M1 pairs uint8 [R, C/2], fp8 scale per 16 values, fp32 global)``."""
    r, c = w.shape
    groups = w.float().view(r, c // 16, 16)
    global_scale = w.abs().max().float() / (6.0 * FP8_MAX)
    scale = (groups.abs().amax(dim=-1) / 6.0 / global_scale).to(torch.float8_e4m3fn)
    step = scale.float().clamp(min=2.0**-9) * global_scale
    scaled = groups / step[..., None]
    nearest = (scaled.abs()[..., None] - E2M1).abs().argmin(dim=-1)
    codes = (nearest + 8 * (scaled < 0).long()).view(r, c)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.to(torch.uint8), scale, global_scale.reshape(())


def nvfp4_values(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    signed = torch.cat([E2M1, -E2M1])
    r, half = packed.shape
    out = torch.empty(r, 2 * half)
    out[:, 0::2] = signed[(packed & 15).long()]
    out[:, 1::2] = signed[(packed >> 4).long()]
    return out * scale.float().repeat_interleave(16, dim=1) * global_scale


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    r, g, _ = blocks.shape
    out = torch.empty(r, g * 32)
    signed = torch.cat([E2M1, -E2M1])
    for i in range(r):
        for k in range(g):
            for b in range(16):
                byte = int(blocks[i, k, b])
                scale = 2.0 ** (int(scales[i, k]) - 127)
                out[i, k * 32 + 2 * b] = signed[byte & 15] * scale
                out[i, k * 32 + 2 * b + 1] = signed[byte >> 4] * scale
    return out


def quantised_pair(src: Path, root: Path, fmt: str, block=(16, 16)) -> tuple[Path, Path]:
    """``(quantised folder, oracle folder: the dequantised weights)`` of the model at ``src``."""
    quant_dir, oracle_dir = root / f"{fmt}-quantised", root / f"{fmt}-oracle"
    for d in (quant_dir, oracle_dir):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    stored, dequantised = {}, {}
    for name, w in tensors.items():
        linear = name.endswith(".weight") and name.split(".")[-2] in LINEARS
        if fmt == "mxfp4":
            linear = linear and ".experts." in name
        if not linear:
            stored[name] = dequantised[name] = w
            continue
        if fmt == "fp8-block":
            q, scale = block_fp8(w, *block)
            stored |= {name: q, name + "_scale_inv": scale}
            dequantised[name] = block_fp8_values(q, scale, *block)
        elif fmt == "fp8":
            q, scale = tensor_fp8(w)
            stored |= {name: q, name + "_scale": scale}
            dequantised[name] = q.float() * scale
        elif fmt == "nvfp4":
            packed, scale, global_scale = nvfp4(w)
            stored |= {name: packed, name + "_scale": scale, name + "_scale_2": global_scale}
            dequantised[name] = nvfp4_values(packed, scale, global_scale)
        else:
            blocks, scales = mxfp4(w)
            stored |= {name + "_blocks": blocks, name + "_scales": scales}
            dequantised[name] = mxfp4_values(blocks, scales)
        assert not torch.equal(dequantised[name], w)  # quantising changed the weights
    save_file(stored, quant_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, oracle_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "mxfp4":
        qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", "self_attn"]}
    elif fmt == "nvfp4":
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
        qc["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    else:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if fmt == "fp8-block":
            qc["weight_block_size"] = list(block)
    (quant_dir / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return quant_dir, oracle_dir


def gpt_oss_mxfp4_pair(src: Path, root: Path) -> tuple[Path, Path]:
    """gpt-oss as released: every expert's ``gate_up_proj`` / ``down_proj`` in MXFP4, stored
    ``[E, out, in / 32, 16]`` (the transpose of transformers' ``[E, in, out]``), with the
    config's ``modules_to_not_convert``; and the oracle with those weights dequantised."""
    quant_dir, oracle_dir = root / "mxfp4-quantised", root / "mxfp4-oracle"
    for d in (quant_dir, oracle_dir):
        shutil.copytree(src, d)
    stored, dequantised = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name] = dequantised[name] = w
            continue
        blocks, scales = (torch.stack(t) for t in zip(*(mxfp4(e.T) for e in w), strict=True))
        stored |= {name + "_blocks": blocks, name + "_scales": scales}
        dequantised[name] = torch.stack(
            [mxfp4_values(b, s).T for b, s in zip(blocks, scales, strict=True)]
        )
        assert not torch.equal(dequantised[name], w)
    save_file(stored, quant_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, oracle_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, oracle_dir
