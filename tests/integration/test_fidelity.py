"""Profile -> plan -> simulate -> run on CPU: the loop closes on this machine.

A tiny Llama is profiled on this machine (one thread, as a rank runs), planned with that
profile for its own device type (``--gpus cpu``), simulated, and run with the runtime on at
most two ranks: the plan the runtime runs is the one simulated (its stages, ranks, batch and
microbatches) and every request gets its tokens. How close the simulated TPOT comes to the
measured one is a speed figure, so it is reported by ``tools/bench/fidelity.py``, not asserted
here (a busy machine would fail any bound tight enough to matter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opweave.cli.app import main
from tests.helpers import run_cli

CONTEXT = 48  # mean context while decoding: prompts of CONTEXT - TOKENS / 2, TOKENS new
TOKENS = 16
BATCH, MICROBATCHES = 4, 2


@pytest.fixture(scope="module")
def profiled(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Llama and its measured CPU profile (a separate process: one thread, pinned)."""
    model_dir = tiny_model("llama")
    path = tmp_path_factory.mktemp("fidelity") / "llama.cpu.json"
    run_cli(
        "profile",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--batches",
        "1,2,4",
        "--contexts",
        "16,64",
        "--repeats",
        "3",
        "-q",
        "-o",
        str(path),
    )
    return model_dir, path


def _prompt_ids(i: int) -> list[int]:
    return [4 + (7 * i + 3 * j) % 500 for j in range(CONTEXT - TOKENS // 2)]


def test_a_simulated_afd_plan_runs_as_simulated(profiled) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.planner import simulate_plan
    from opweave.profiler import load_profile
    from opweave.runtime import Request, RunOptions, run_plan

    model_dir, path = profiled
    profile = load_profile(path)
    # two local ranks share the loopback link the profiler measured as the intra-node link
    device = profile.device.model_copy(update={"gpus_per_node": max(os.cpu_count() or 1, 2)})
    profile = profile.model_copy(update={"device": device})
    spec = load_model(model_dir)
    plan = canonical_plan(
        spec, "afd", gpu="cpu", batch=BATCH, microbatches=MICROBATCHES, context_tokens=CONTEXT
    )
    sim = simulate_plan(plan, spec, profiles=[profile])
    assert sim.tpot_s > 0 and sim.stages_per_token == 2 * spec.num_layers
    requests = [
        Request(tuple(_prompt_ids(i)), TOKENS, request_id=f"r{i}", stop_token_ids=())
        for i in range(BATCH)
    ]
    result = run_plan(plan, model_dir, requests, RunOptions(device="cpu", timeout_s=60))
    assert result is not None and result.tpot_s is not None and result.tpot_s > 0
    assert [len(o.token_ids) for o in result.outputs] == [TOKENS] * BATCH
    assert len(result.ranks) == 2  # attention and FFN owners, one rank each


def test_cli_plan_with_a_cpu_profile_then_run(profiled, tmp_path, capsys) -> None:
    model_dir, path = profiled
    plan_path = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            str(model_dir),
            "--gpus",
            "cpu",
            "--profile",
            str(path),
            "--context",
            str(CONTEXT),
            "--tpot-slo-ms",
            "1000",
            "--batch",
            str(BATCH),
            "--microbatches",
            str(MICROBATCHES),
            "-o",
            str(plan_path),
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    best = json.loads(out.out)["best"]
    assert all(o["resident_batch"] == BATCH and o["replicas"] == 1 for o in best["owners"])
    plan = json.loads(plan_path.read_text())
    assert plan["microbatches"] == MICROBATCHES and plan["owners"][0]["gpu"] == "cpu"
    ranks = sum(o["replicas"] * o["tp"] * o.get("dp", 1) for o in plan["owners"])
    assert ranks == len(plan["owners"]) <= 2

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_token_ids": _prompt_ids(i)}) + "\n" for i in range(BATCH))
    )
    code = main(
        [
            "run",
            str(plan_path),
            "--model-path",
            str(model_dir),
            "--ranks",
            str(ranks),
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            str(TOKENS),
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    assert len(doc["outputs"]) == BATCH and len(doc["ranks"]) == ranks
    assert all(1 <= len(o["token_ids"]) <= TOKENS for o in doc["outputs"])
    assert doc["tpot_s"] is None or doc["tpot_s"] > 0  # None: every request stopped at EOS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--batch", "6", "--microbatches", "4"), "--batch 6 is not divisible by --microbatches 4"),
        (("--batch", "4"), "--batch needs exactly one --microbatches count"),
        (("--batch", "4", "--microbatches", "1,2"), "--batch needs exactly one --microbatches"),
        (("--microbatches", "0"), "--microbatches takes counts from 1 to"),
        (("--max-owners", "4"), "--max-owners must be 1, 2 or 3"),
    ],
)
def test_local_batch_options_are_checked(capsys, options, message) -> None:
    args = ["plan", "qwen3-32b", "--gpus", "h100", "--context", "8K", "--tpot-slo-ms", "50"]
    code = main([*args, *options])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
