"""Helpers shared by the test modules (import as ``tests.helpers``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}

# `opweave deploy --image`, which has no default (no public image exists)
IMAGE = ("--image", "registry.example.com/opweave:1.0")


def load_script(path: Path) -> ModuleType:
    """A script of tools/ (not a package) as a module, registered under its file name so its
    dataclasses resolve their module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``opweave`` as a user would: a fresh process, output captured."""
    env = {k: v for k, v in os.environ.items() if k != "OPWEAVE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "opweave.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"opweave {' '.join(args)} failed: {proc.stderr}")
    return proc


def cli_json(*args: str) -> Any:
    proc = run_cli(*args, "--json")
    return json.loads(proc.stdout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_gloo_pair(rank: int, port: int) -> None:
    """Join a two-process gloo group on 127.0.0.1:``port`` as ``rank`` (a test's spawned
    process: both import torch first, so the group's own timeout is only against a hang)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )


def _gloo_pair_rank(target: Callable[[int], Any], rank: int, port: int, out: Any) -> None:
    try:
        join_gloo_pair(rank, port)
        out.put((rank, target(rank)))
    except BaseException:  # the test's assertion shows it, instead of a bare queue timeout
        out.put((rank, f"rank {rank} raised: {traceback.format_exc()}"))
    out.close()
    out.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)  # no process-group teardown: a peer may have given up on the group


def run_gloo_pair(target: Callable[[int], Any]) -> dict[int, Any]:
    """``target(rank)`` in two spawned processes joined in a gloo group; what each returned
    (or a text of what it raised), by rank (``target`` a module-level function, for the
    spawn to import)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_pair_rank, args=(target, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=240) for _ in procs)  # only against a hang
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def start_opweave(
    args: list[str], tmp: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``opweave ARGS`` in a session of its own with SIGINT at its default disposition (a
    shell starts background jobs with it ignored, and the test's own process may be one), and
    a temporary folder of its own (``TMPDIR``: other test runs share /tmp); the process, its
    log and that folder. Without ``OPWEAVE_DEBUG`` (its tracebacks replace the one-line
    errors) or ``VLLM_ENABLE_V1_MULTIPROCESSING`` (a server's engine runs in a process of its
    own)."""
    temp = tmp / "tmp"
    temp.mkdir()
    log = tmp / "out.log"
    unset = ("OPWEAVE_DEBUG", "VLLM_ENABLE_V1_MULTIPROCESSING")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ |= {"TMPDIR": str(temp), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "opweave.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    return proc, log, temp


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a server started with ``start_new_session=True`` (unless it already exited);
    after 60 s, SIGKILL its whole process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tiny_llama_with_plan(root: Path, strategy: str) -> tuple[Path, Path]:
    """A tiny llama (hidden 128, head dim 32) and a canonical ``strategy`` plan file for it,
    with batch 4 in 2 microbatches: one rank per owner."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model

    model = write_tiny_model(
        "llama", root / "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    plan = root / "plan.json"
    plan.write_text(
        canonical_plan(
            load_model(model), strategy, gpu="cpu", batch=4, microbatches=2
        ).model_dump_json()
    )
    return model, plan


def tiny_llama(root: Path) -> Path:
    """A tiny llama vLLM's CPU attention accepts (head dim 32), shardable over TP 2."""
    from opweave.runtime import write_tiny_model

    return write_tiny_model(
        "llama", root / "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )


def descendants(pid: int) -> dict[int, str]:
    """Live descendants of ``pid`` and their process names (from /proc)."""
    parent: dict[int, int] = {}
    names: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text.split("(", 1)[1].rsplit(")", 1)
        fields = rest.split()
        if fields[0] != "Z":  # zombies are dead
            parent[int(stat.parent.name)] = int(fields[1])
            names[int(stat.parent.name)] = name
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in found:
                found[child] = names[child]
                frontier.append(child)
    return found


def rank_pids(pid: int) -> dict[int, int]:
    """Rank number -> pid of the ranks under process ``pid`` (they name themselves)."""
    return {
        int(name.removeprefix("opweave-rank")): child
        for child, name in descendants(pid).items()
        if name.startswith("opweave-rank")
    }


def http(url: str, body: Any = None, key: str | None = None, timeout: float = 120):
    """``(status, body bytes)``; HTTP errors are answers here, not exceptions."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def health(base: str) -> int | None:
    """``/health``'s status, or ``None`` when nothing answers."""
    try:
        return http(base + "/health", timeout=5)[0]
    except OSError:
        return None


def start_server(
    args: list[str], log: Path, *, timeout_s: float = 240, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``opweave run ARGS --port P`` in a session of its own; returns once ``/health`` is 200."""
    import time

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    environ |= {"HF_HUB_OFFLINE": "1", **(env or {})}
    out = open(log, "wb")  # noqa: SIM115 -- the server's process keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "opweave.cli", "run", *args, "--port", str(port)],
        env=environ,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while health(base) != 200:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise AssertionError(f"server not healthy in {timeout_s} s: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, base


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """``(local address, port, pid)`` of every TCP socket in LISTEN state that one of ``pids``
    holds (tools/gpu/sockets.py)."""
    return sockets().listening(pids)


@functools.cache
def sockets() -> ModuleType:
    """tools/gpu/sockets.py (loaded once): what processes hold and listen on, and a flood."""
    return load_script(Path(__file__).resolve().parents[1] / "tools" / "gpu" / "sockets.py")


# Qwen/Qwen3.5-27B's text_config (the dense sibling: no experts, a SwiGLU MLP in every layer)
QWEN3_5_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "max_position_embeddings": 262144,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "dtype": "bfloat16",
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}


# zai-org/GLM-4.5's config.json (GLM-4.6 and -4.7 share its shapes)
GLM_4_5: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 151552,
}


def hf_causal_lm(model_dir: Path, **kwargs: Any) -> Any:
    """transformers' model of a checkpoint for text generation: its causal LM, or (a multimodal
    wrapper transformers registers only as image-text-to-text, e.g. Qwen3-VL) that model, whose
    ``generate`` and forward take text-only ``input_ids`` alike."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
