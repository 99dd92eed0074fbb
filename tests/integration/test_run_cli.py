"""``opweave run``: the CLI contract, plan files, two nodes on one machine, torchrun, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opweave.cli.app import main
from opweave.costmodel import canonical_plan, load_model
from tests.helpers import free_port

MAX_TOKENS = 16  # shares hf_greedy's cache with the runtime tests


def _opweave(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _prompts_file(tmp_path: Path, prompts) -> Path:
    """Token-id prompts, one of them given as text through the model's tokenizer."""
    lines = [{"prompt": " ".join(f"t{t}" for t in prompts[0])}]
    lines += [{"prompt_token_ids": list(p)} for p in prompts[1:]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_run_strategy_json_document(tmp_path, capsys, tiny_model, hf_greedy, prompts):
    model_dir = tiny_model("llama")
    code, out, err = _opweave(
        capsys,
        "run",
        "--strategy",
        "afd",
        "--model-path",
        str(model_dir),
        "--prompts-file",
        str(_prompts_file(tmp_path, prompts)),
        "--max-tokens",
        str(MAX_TOKENS),
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert [o["prompt_token_ids"] for o in doc["outputs"]] == [list(p) for p in prompts]
    assert [o["token_ids"] for o in doc["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert doc["outputs"][0]["text"].split() == [f"t{t}" for t in doc["outputs"][0]["token_ids"]]
    assert doc["tpot_s"] > 0 and doc["strategy"] == "afd"
    assert [r["stages"] for r in doc["ranks"]] == [
        ["embed..L0.o_proj", "L1.attn_norm..L1.o_proj"],
        ["L0.ffn_norm..L0.down_proj", "L1.ffn_norm..sample"],
    ]
    for r in doc["ranks"]:
        assert r["weight_bytes_read"] > 0 and r["busy_s"] > 0


def test_run_plan_file_with_text_prompts_prints_a_table(tmp_path, capsys, tiny_model):
    model_dir = tiny_model("qwen3_moe")
    plan = canonical_plan(load_model(model_dir), "cad", gpu="cpu", batch=2, microbatches=2)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    code, out, err = _opweave(
        capsys,
        "run",
        str(plan_path),
        "--model-path",
        str(model_dir),
        "--prompt",
        "t5 t6 t7",
        "--prompt",
        "t9 t10",
        "--max-tokens",
        "3",
    )
    assert code == 0, err
    assert out.startswith("[req-0] t")
    assert "TPOT" in out and "weights read" in out and "L0.core_attn" in out


def test_bad_input_is_one_line_errors(tmp_path, capsys, monkeypatch, tiny_model):
    model_dir = str(tiny_model("llama"))
    capsys.readouterr()  # writing the model (when this test is the first to) prints progress
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=2)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    common = ("--model-path", model_dir, "--max-tokens", "2")
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt_token_ids": "oops"}\n')
    cases = [
        (
            ("run", str(plan_path), "--ranks", "3", "--prompt", "t5", *common),
            "the plan needs 2 ranks",
        ),
        (("run", str(plan_path), "--prompts-file", str(bad_file), *common), "bad.jsonl line 2"),
        *(
            (
                ("run", str(plan_path), "--prompts-file", str(path), *common),
                f"{path.name} line 1: token id {token} is outside the vocabulary (0..",
            )
            for token, path in [(-1, tmp_path / "neg.jsonl"), (10**6, tmp_path / "big.jsonl")]
            if path.write_text(f'{{"prompt_token_ids": [5, {token}]}}\n')
        ),
        (
            ("run", str(plan_path), "--strategy", "cad", "--prompt", "t5", *common),
            "give either a PLAN file or --strategy",
        ),
        (
            ("run", "--strategy", "afd", "--tp", "2", "--ranks", "3", "--prompt", "t5", *common),
            "the plan needs 4 ranks (replicas x tp x dp, summed over its owners), got 3",
        ),
        (
            ("run", "--strategy", "afd", "--tp", "8", "--prompt", "t5", *common),
            "cannot shard L0.qkv_proj: attention heads of 4 does not split over tp 8",
        ),
        (
            (
                "run",
                str(plan_path),
                "--model-path",
                str(tmp_path),
                "--prompt",
                "t5",
                "--max-tokens",
                "2",
            ),
            "not a model folder",
        ),
        (
            ("run", "--decode-step", "fast", "--prompt", "t5", *common),
            "--decode-step must be one of per-request, static, compiled, traced",
        ),
        (
            ("run", "--strategy", "afd", "--batch", "1", "--prompt", "t5", *common),
            "--batch 1 is below the 2 microbatches of this plan: each needs a slot; give "
            "--batch 2 or more, or --microbatches 1",
        ),
    ]
    for args, message in cases:
        code, out, err = _opweave(capsys, *args)
        assert code == 2, args
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err
        assert out == ""
    code, out, err = _opweave(capsys, "run", str(plan_path), "--wait", "sometimes", *common)
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert err.endswith("--wait must be one of auto, spin, block\n"), err


def test_a_deepseek_config_the_runtime_cannot_route_is_one_line(tmp_path, capsys, tiny_model):
    """Group-limited routing with one expert a group: planned, but not run (exit 2)."""
    import shutil

    folder = tmp_path / "one-per-group"
    shutil.copytree(tiny_model("deepseek_v3"), folder)
    capsys.readouterr()  # the tiny model's writing, if this test wrote it
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"n_group": 8}))
    args = ("--strategy", "afd", "--model-path", str(folder), "--prompt", "t5")
    code, out, err = _opweave(capsys, "run", *args, "--max-tokens", "2")
    assert (code, out) == (2, "")
    assert err == (
        "error: n_group: 8 groups of one expert; group-limited routing ranks a group by its two "
        "best experts, so a group needs at least 2\n"
    )


def test_a_bad_choice_is_refused_before_torch_loads_naming_the_runtimes_choices(tiny_model):
    """``opweave run`` checks --kernels, --decode-step and --wait before it imports the runtime
    (which imports torch), so it keeps its own tuples of their choices: those must be the choices
    RunOptions parses, as the runtime names them."""
    from opweave.runtime import DecodeStep, Kernels, Wait

    model_dir = str(tiny_model("llama"))
    code = (
        "import sys\n"
        "from opweave.cli.app import main\n"
        "status = main(sys.argv[1:])\n"
        "print(status, sorted(m for m in ('torch', 'opweave.runtime') if m in sys.modules))\n"
    )
    for flag, choices in (("--kernels", Kernels), ("--decode-step", DecodeStep), ("--wait", Wait)):
        args = ["run", flag, "fastest", "--prompt", "t5", "--max-tokens", "2"]
        proc = subprocess.run(
            [sys.executable, "-c", code, *args, "--model-path", model_dir],
            capture_output=True,
            text=True,
        )
        assert proc.stdout == "2 []\n", proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
        assert proc.stderr.endswith(f"{flag} must be one of {', '.join(choices)}\n")


def test_two_nodes_on_one_machine(tmp_path, capsys, monkeypatch, tiny_model, hf_greedy, prompts):
    """One ``opweave run`` per node (--nnodes 2): node 0 hosts the rendezvous and rank 0; the
    nodes share the run's secret."""
    monkeypatch.setenv("OPWEAVE_RUN_SECRET", "a secret both nodes know")
    model_dir = tiny_model("llama")
    port = str(free_port())
    prompts_file = str(_prompts_file(tmp_path, prompts))
    args = [
        "run",
        "--strategy",
        "cad",
        "--ranks",
        "2",
        "--model-path",
        str(model_dir),
        "--prompts-file",
        prompts_file,
        "--max-tokens",
        str(MAX_TOKENS),
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--timeout-s",
        "60",
        "--json",
    ]
    node0 = subprocess.Popen(
        [sys.executable, "-m", "opweave.cli", *args, "--node-rank", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code, out, err = _opweave(capsys, *args, "--node-rank", "1")
        stdout, stderr = node0.communicate(timeout=120)
    finally:
        node0.kill()
    assert code == 0, err
    assert json.loads(out) == {"node_rank": 1, "outputs": None}
    assert node0.returncode == 0, stderr
    doc = json.loads(stdout)
    assert [o["token_ids"] for o in doc["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["driver"]["start_method"] == "fork"  # the CLI forks while it has one thread


def test_a_node_with_another_secret_is_refused_and_the_run_waits_for_the_right_one(
    tmp_path, capsys, monkeypatch, tiny_model
):
    """A node whose OPWEAVE_RUN_SECRET differs from node 0's says so at once (its ranks used to
    wait, without a word, until the join deadline); node 0 warns and keeps waiting, so the
    node started again with the right secret joins."""
    model_dir = tiny_model("llama")
    port = str(free_port())
    args = [
        *("run", "--strategy", "cad", "--ranks", "2", "--model-path", str(model_dir)),
        *("--prompt", "t5 t6", "--max-tokens", "2", "--nnodes", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", port),
    ]
    env = dict(os.environ, OPWEAVE_RUN_SECRET="node zero's secret")
    node0 = subprocess.Popen(
        [sys.executable, "-m", "opweave.cli", *args, "--node-rank", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        monkeypatch.setenv("OPWEAVE_RUN_SECRET", "another secret")
        code, _, err = _opweave(capsys, *args, "--node-rank", "1")
        assert code == 2
        assert err == (
            f"error: node 0's run at 127.0.0.1:{port} has another secret than node 1's: set "
            "OPWEAVE_RUN_SECRET to the same value on every node\n"
        )
        monkeypatch.setenv("OPWEAVE_RUN_SECRET", "node zero's secret")
        code, _, err = _opweave(capsys, *args, "--node-rank", "1")
        assert code == 0, err
        _, stderr = node0.communicate(timeout=120)
    finally:
        node0.kill()
    assert node0.returncode == 0, stderr
    assert stderr == (
        "warning: node 1 was started with another OPWEAVE_RUN_SECRET and cannot join; start it "
        "again with this node's value\n"
    )


def test_torchrun_style_launch(tmp_path, tiny_model, hf_greedy, prompts):
    """Ranks started by an outside launcher (torchrun's RANK/WORLD_SIZE/... variables) each run
    ``opweave run`` themselves; rank 0 prints the document."""
    model_dir = tiny_model("llama")
    prompts_file = str(_prompts_file(tmp_path, prompts))
    port = str(free_port())
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover -- child
            code = 1
            try:
                import torch

                torch.set_num_threads(1)
                sys.stdout = open(tmp_path / f"rank{rank}.out", "w")  # noqa: SIM115
                os.environ.update(
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    GLOO_SOCKET_IFNAME="lo",
                    OPWEAVE_RUN_SECRET="shared by torchrun's ranks",
                )
                code = main(
                    [
                        "run",
                        "--strategy",
                        "afd",
                        "--model-path",
                        str(model_dir),
                        "--prompts-file",
                        prompts_file,
                        "--max-tokens",
                        str(MAX_TOKENS),
                        "--timeout-s",
                        "30",
                        "--json",
                    ]
                )
                sys.stdout.flush()
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0]
    doc = json.loads((tmp_path / "rank0.out").read_text())
    assert [o["token_ids"] for o in doc["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert (tmp_path / "rank1.out").read_text() == ""


@pytest.mark.slow
def test_spawned_workers(tiny_model, hf_greedy, prompts):
    """The start method CUDA uses (fresh interpreters), exercised on CPU."""
    from opweave.runtime import Request, RunOptions, run_plan

    model_dir = tiny_model("llama")
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4)
    requests = [Request(tuple(p), MAX_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=60), start_method="spawn")
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(model_dir, prompts, MAX_TOKENS)


def test_decode_step_static_in_the_json_document(capsys, tiny_model):
    """--decode-step reaches every rank; --json reports it with the launches per token."""
    model_dir = str(tiny_model("llama"))
    capsys.readouterr()
    args = ("run", "--strategy", "afd", "--model-path", model_dir, "--max-tokens", "4")
    runs = {}
    for step in ("per-request", "static"):
        code, out, _ = _opweave(capsys, *args, "--prompt", "t5 t6", "--decode-step", step, "--json")
        assert code == 0
        runs[step] = json.loads(out)
    assert [o["token_ids"] for o in runs["static"]["outputs"]] == [
        o["token_ids"] for o in runs["per-request"]["outputs"]
    ]
    for rank in runs["static"]["ranks"]:
        assert rank["decode_step"] == "static"
        assert rank["submissions_per_token"] > 0 and rank["host_s_per_token"] >= 0


def test_a_prompts_files_own_budgets_need_no_max_tokens(tmp_path, capsys, tiny_model):
    model_dir = str(tiny_model("llama"))
    capsys.readouterr()
    own = tmp_path / "own.jsonl"
    own.write_text(
        '{"prompt_token_ids": [5, 6], "max_tokens": 2}\n{"prompt": "t7", "max_tokens": 4}\n'
    )
    code, out, err = _opweave(
        capsys, "run", "--model-path", model_dir, "--prompts-file", str(own), "--json"
    )
    assert code == 0, err
    assert [len(o["token_ids"]) for o in json.loads(out)["outputs"]] == [2, 4]
    partly = tmp_path / "partly.jsonl"
    partly.write_text('{"prompt_token_ids": [5], "max_tokens": 2}\n{"prompt_token_ids": [6]}\n')
    code, out, err = _opweave(
        capsys, "run", "--model-path", model_dir, "--prompts-file", str(partly)
    )
    assert (code, out) == (2, "")
    assert err.startswith('error: request 1 of the prompts file has no "max_tokens"'), err
    code, out, err = _opweave(capsys, "run", "--model-path", model_dir, "--prompt", "t5")
    assert code == 2 and "--prompt needs --max-tokens" in err


@pytest.mark.parametrize(("ep", "tp"), [(2, 1), (4, 2)])
def test_run_with_expert_parallelism(ep, tp, tmp_path, capsys, tiny_model, hf_greedy, prompts):
    """``--ep 2``: the MoE owner over two ranks, each an attention replica with half the batch
    and half the experts; ``--ep 4 --tp 2``: two attention replicas of two TP ranks each, a
    quarter of the experts on each rank."""
    model_dir = tiny_model("qwen3_moe")
    capsys.readouterr()
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": list(p)}) + "\n" for p in prompts))
    args = ("--model-path", str(model_dir), "--prompts-file", str(path))
    code, out, err = _opweave(
        capsys, "run", "--ep", str(ep), "--tp", str(tp), *args, "--max-tokens", str(MAX_TOKENS),
        "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert [o["token_ids"] for o in doc["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    owner = doc["plan"]["owners"][0]
    assert (owner["tp"], owner["ep"], owner["dp"]) == (tp, ep, ep // tp)
    assert [(r["owner"], r["replica"]) for r in doc["ranks"]] == [
        (0, d) for d in range(ep // tp) for _ in range(tp)
    ]


def test_bad_expert_parallelism_is_one_line_errors(tmp_path, capsys, tiny_model):
    moe, dense = str(tiny_model("qwen3_moe")), str(tiny_model("llama"))
    capsys.readouterr()
    plan = canonical_plan(load_model(moe), "colocated", gpu="cpu", batch=2)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    prompt = ("--prompt", "t5", "--max-tokens", "2")
    cases = [
        (("--ep", "2", "--model-path", dense), "has no routed experts (a dense model); drop --ep"),
        (("--ep", "16", "--model-path", moe), "--ep 16 is more than the 8 routed experts"),
        (("--ep", "2", "--tp", "4", "--model-path", moe), "--ep 2 is not a multiple of --tp 4"),
        ((str(plan_path), "--ep", "2", "--model-path", moe), "--ep, --replicas, --batch and"),
        (
            ("--ep", "2", "--microbatches", "2", "--batch", "4", "--model-path", moe),
            "microbatch 0 has 2, 0 slots on the data-parallel ranks of replica 0",
        ),
    ]
    for args, message in cases:
        code, out, err = _opweave(capsys, "run", *args, *prompt)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err
        assert out == ""


def test_run_with_a_prefill_pool_reports_ttft_tpot_and_the_bytes_moved(
    tmp_path, capsys, tiny_model, hf_greedy, prompts
):
    """--prefill-replicas: the prompts run on the prefill pool, the tokens stay transformers',
    and --json has each request's TTFT, TPOT and state bytes (2 layers x 2 KV heads x 16 dims
    x 2 (K, V) x 4 bytes per prompt token of the tiny llama) and the pool's total."""
    model_dir = tiny_model("llama")
    c = json.loads((model_dir / "config.json").read_text())
    per_token = c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * 4
    code, out, err = _opweave(
        capsys, "run", "--strategy", "cad", "--tp", "2", "--prefill-replicas", "1",
        "--model-path", str(model_dir), "--prompts-file", str(_prompts_file(tmp_path, prompts)),
        "--max-tokens", str(MAX_TOKENS), "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert [o["token_ids"] for o in doc["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert doc["plan"]["prefill"]["replicas"] == 1 and doc["plan"]["prefill"]["tp"] == 2
    for o in doc["outputs"]:
        assert o["ttft_s"] > 0 and o["tpot_s"] > 0
        assert o["transfer_bytes"] == per_token * len(o["prompt_token_ids"])
    assert doc["transfer"]["bytes"] == per_token * sum(len(p) for p in prompts)
    assert doc["transfer"]["messages"] == 2 * len(prompts)  # one per request and TP rank
    assert [r["pool"] for r in doc["ranks"]] == ["decode"] * 4 + ["prefill"] * 2
    assert doc["ttft_s"] > 0


def test_prefill_replicas_with_a_plan_file_is_one_error_line(tmp_path, capsys, tiny_model):
    model_dir = tiny_model("llama")
    plan_path = tmp_path / "plan.json"
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=2)
    plan_path.write_text(plan.model_dump_json())
    capsys.readouterr()  # the tiny model's writing, if this test wrote it
    code, _, err = _opweave(
        capsys, "run", str(plan_path), "--prefill-replicas", "2", "--model-path", str(model_dir),
        "--prompt", "t5 t6", "--max-tokens", "2",
    )  # fmt: skip
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --prefill-replicas applies to --strategy; a plan file names its own prefill pool"
    ]
