"""``opweave models`` and ``opweave gpus``: the built-in catalogs."""

from __future__ import annotations

import typer

from ._common import catalog, emit_json, human_bytes
from ._console import print_table
from ._options import HardwareOpt, JsonOpt


def register(app: typer.Typer) -> None:
    app.command("models")(models)
    app.command("gpus")(gpus)


def models(json_out: JsonOpt = False) -> None:
    """List the built-in models with their family, size and partition block."""
    from opweave.costmodel import BUILTIN_MODELS, load_model

    rows = []
    for name, (_, repo) in BUILTIN_MODELS.items():
        spec = load_model(name)
        kinds = sorted({layer.attention.value for layer in spec.layers})
        rows.append(
            {
                "name": name,
                "hf_repo": repo,
                "family": spec.family,
                "dtype": spec.dtype,
                "layers": spec.num_layers,
                "weight_bytes": spec.weight_bytes,
                "gemm_flops_per_token": spec.gemm_flops_per_token,
                "block_layers": spec.block.period_layers,
                "block_prefix_layers": spec.block.prefix_layers,
                "attention_kinds": kinds,
                "kv_bytes_per_request_at_32k": float(spec.state_bytes_per_request(32768)),
            }
        )
    if json_out:
        emit_json({"models": rows})
        return
    print_table(
        [
            [
                r["name"],
                r["family"],
                str(r["layers"]),
                human_bytes(r["weight_bytes"]),
                (f"{r['block_prefix_layers']}+" if r["block_prefix_layers"] else "")
                + str(r["block_layers"]),
                "+".join(r["attention_kinds"]),
                human_bytes(r["kv_bytes_per_request_at_32k"]),
            ]
            for r in rows
        ],
        ["model", "family", "layers", "weights", "block", "attention", "state@32K/req"],
        text=(0, 1, 5),
    )


def gpus(json_out: JsonOpt = False, hardware: HardwareOpt = None) -> None:
    """List the GPU catalog: memory, bandwidth, compute, links, price and its basis."""
    cat = catalog(hardware)
    rows = [gpu.model_dump() for gpu in cat]
    if json_out:
        emit_json({"gpus": rows})
        return
    print_table(
        [
            [
                g.id,
                f"{g.memory_bytes / 2**30:.1f} GiB",  # as nvidia-smi's MiB total reads
                f"{g.mem_bandwidth_bytes_per_s / 1e12:.2f}",
                f"{g.dense_flops_per_s / 1e12:.0f}",
                _tflops(g.fp8_flops_per_s),
                _tflops(g.fp4_flops_per_s),
                g.intra_node_link,
                f"{g.network_bandwidth_bytes_per_s * 8 / 1e9:.0f}",
                "-" if g.usd_per_hour is None else f"{g.usd_per_hour:.2f}",
                _price_basis(g.price_source),
            ]
            for g in cat
        ],
        [
            "gpu",
            "memory",
            "HBM TB/s",
            "BF16 TFLOPS",
            "FP8",
            "FP4",
            "intra-node",
            "net Gb/s",
            "USD/h",
            "price basis",
        ],
        text=(0, 6, 9),
    )
    typer.echo(
        "\nPrices: on-demand list prices per GPU-hour, from one provider and tier (RunPod "
        "Community Cloud, runpod.io/pricing) for every GPU it lists, so ratios between GPU "
        "types are fair; hyperscalers list the same GPUs at 2-4x. Override with --hardware "
        "FILE (usd_per_hour, price_source)."
    )


def _tflops(rate: float | None) -> str:
    """A dense tensor rate in TFLOPS; "-" where the GPU has no such tensor cores."""
    return "-" if rate is None else f"{rate / 1e12:.0f}"


def _price_basis(source: str) -> str:
    """The catalog's price source without its citation key (the table's footnote explains it)."""
    return source.removeprefix("[PRICE] ").strip() or "-"
