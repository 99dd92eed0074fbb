"""An AFD plan's two ranks on one GPU as two "nodes", their ports flooded and held while it serves.

A lent machine has one GPU and NCCL refuses two ranks of one communicator on one device; given
different ``NCCL_HOSTID`` values, the two nodes' ranks are two hosts to NCCL, which joins them
through its socket transport on loopback. Node 0 (this process) drives the run; node 1 is a
child process (``run_node``). Once every rank has reported ready (every connection made, every
listening port closed: ``opweave.runtime._private.connect``), each port the ranks listen on is
flooded with connect-and-close attempts and then holds silent connections while the plan
generates; the tokens must be transformers' and no descriptor may stay behind.

Prints one JSON object and writes it to ``--out``; exit status 0 when it held.
Run: ``python tools/gpu/two_nodes.py --out two_nodes.json`` (``--device cpu`` rehearses it
through the torch point-to-point seam, the path CUDA ranks take).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import MAX_NEW_TOKENS, PROMPTS, _hf_greedy
from sockets import descriptors, flood, hold, listening

NODE1 = textwrap.dedent(
    """
    import json, sys
    from opweave.costmodel import Plan, load_model
    from opweave.runtime import RunOptions, Topology, run_node

    plan = Plan.model_validate_json(sys.argv[1])
    options = RunOptions.model_validate_json(sys.argv[3])
    topology = Topology(2, 1, None, "127.0.0.1", int(sys.argv[4]))
    run_node(plan, load_model(sys.argv[2]), sys.argv[2], options, topology)
    """
)


def _descendants(root: int) -> list[int]:
    """Pids of every process below ``root``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out = []
    for pid in parents:
        p = pid
        while p in parents and p != root:
            p = parents[p]
        if p == root and pid != root:
            out.append(pid)
    return sorted(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import (
        Cluster,
        OfflineDriver,
        Request,
        RunOptions,
        Topology,
        write_tiny_model,
    )

    found: dict[str, Any] = {"device": args.device}
    with tempfile.TemporaryDirectory(prefix="opweave-two-nodes-") as tmp:
        model_dir = write_tiny_model("llama", Path(tmp) / "llama")
        expected = _hf_greedy(model_dir, args.device)
        model = load_model(model_dir)
        plan = canonical_plan(model, "afd", gpu="cpu", batch=len(PROMPTS), microbatches=1)
        options = RunOptions(device=args.device, timeout_s=30, test_torch_p2p=args.device == "cpu")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["OPWEAVE_RUN_SECRET"] = secrets.token_hex(16)
        node1_env = {**os.environ, "NCCL_HOSTID": "opweave-node-1"}
        os.environ["NCCL_HOSTID"] = "opweave-node-0"
        start = time.perf_counter()
        node1 = subprocess.Popen(
            [
                sys.executable,
                "-c",
                NODE1,
                plan.model_dump_json(),
                str(model_dir),
                options.model_dump_json(),
                str(port),
            ],
            env=node1_env,
        )
        topology = Topology(2, 0, None, "127.0.0.1", port)
        cluster = Cluster(plan, model, model_dir, options, topology=topology)
        held: list[socket.socket] = []
        try:
            found["ready_s"] = round(time.perf_counter() - start, 1)
            # node 0's ranks and node 1's (under its process: a launcher, then the rank)
            pids = [*cluster.pids, *_descendants(node1.pid)]
            ports = sorted({(addr, port) for addr, port, _ in listening(pids)})
            found["rank_pids"], found["listening_ports"] = len(pids), len(ports)
            before = {pid: descriptors(pid) for pid in pids}
            found["flood"] = flood(ports, 1.0)
            held = hold(ports, 32)
            requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in PROMPTS]
            driver = OfflineDriver(cluster, requests, model.arch.eos_token_ids)
            driver.run()
            got = [list(out.token_ids) for out in driver.outputs()]
            found["equal_to_transformers"] = got == expected
            found["descriptors_added"] = sum(descriptors(pid) - before[pid] for pid in pids)
            cluster.shutdown()
        finally:
            for sock in held:
                sock.close()
            cluster.close()
            try:
                found["node1_status"] = node1.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node1.kill()
                found["node1_status"] = "killed"
    found["ok"] = (
        found.get("equal_to_transformers") is True
        and found.get("descriptors_added") == 0
        and all(f["made"] == 0 for f in found.get("flood", []))
        and found.get("node1_status") == 0
    )
    print(json.dumps(found), flush=True)
    args.out.write_text(json.dumps(found, indent=1) + "\n")
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
