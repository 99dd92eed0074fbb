"""What a local process without a run's secret can do to NCCL's listening sockets.

Two ranks share the one GPU of a lent machine: each gets its own ``NCCL_HOSTID``, so NCCL takes
them for two hosts and joins them through its socket transport on loopback (which listens on more
ports than NVLink inside one node would: bootstrap, proxy and the transport's own). The rendezvous
is a file, as in ``opweave run``. Each scenario starts a fresh pair:

* ``guarded`` (run first): ``NCCL_RUNTIME_CONNECT=0`` (every algorithm is connected when a
  communicator is made), a warm-up (an all-reduce, then send/recv both ways), then each rank's
  listening ports drop new connections (``refuse_new_connections``, what CPU ranks do once they
  have joined); then a connect-and-close flood against every port the ranks listen on (it must
  make no connection), then all-reduces and send/recv of 4 KiB to 64 MiB on the warmed group.
* ``default`` (run second): NCCL as it comes; the same warm-up and flood.

Then, in both, silent connections are held open on every port while the ranks make a new
communicator (a new group) and use it: found, not checked (NCCL makes it through the listening
ports the guard closed, or behind the held connections). After each phase every rank reports its
listening ports, open descriptors and connections left in CLOSE-WAIT. One JSON object per
scenario goes to ``--out``, saved after every phase; a rank that does not answer within
``REPLY_S`` ends its scenario (``hung_in`` names the phase). The exit status is 0 when every
check of the guarded scenario passed.

Run: ``python tools/gpu/nccl_sockets.py --out nccl.json`` (``--device cpu`` rehearses the same
code with gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sockets import (
    CLOSE_WAIT,
    ESTABLISHED,
    LISTEN,
    descriptors,
    flood,
    hold,
    socket_inodes,
    tcp_sockets,
)

FLOOD_S = 1.0  # per port
HOLD = 32  # silent connections held open per port
REPLY_S = 20.0  # longest wait for the ranks' answers before they count as hung
SIZES = (4 << 10, 1 << 20, 64 << 20)


def _own_sockets() -> dict[str, Any]:
    """This process's listening TCP ports, descriptors, sockets by state and unix sockets."""
    tcp = tcp_sockets([os.getpid()])
    inodes = socket_inodes(os.getpid())
    unix = []
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if len(fields) > 7 and fields[6] in inodes:
                unix.append(fields[7])
    return {
        "listen": sorted([addr, port] for state, addr, port, _ in tcp if state == LISTEN),
        "fds": descriptors(os.getpid()),
        "close_wait": sum(state == CLOSE_WAIT for state, *_ in tcp),
        "established": sum(state == ESTABLISHED for state, *_ in tcp),
        "unix": sorted(unix),
    }


def _rank(rank: int, init_file: str, device: str, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    dev = torch.device(device)
    kwargs: dict[str, Any] = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev  # NCCL's communicator is made now, not at the first call
    start = time.perf_counter()
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=REPLY_S),
        **kwargs,
    )
    conn.send(("ok", {"init_s": round(time.perf_counter() - start, 2)}))
    groups: dict[str, Any] = {"world": None}
    peer = 1 - rank

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def all_reduce(nbytes: int, group: Any) -> bool:
        t = torch.full((nbytes // 4,), float(rank + 1), device=dev)
        dist.all_reduce(t, group=group)
        sync()
        return bool((t == 3.0).all())

    def p2p(nbytes: int, group: Any) -> bool:
        out = torch.full((nbytes // 4,), float(rank + 1), device=dev)
        into = torch.zeros_like(out)
        if rank == 0:
            dist.send(out, peer, group=group)
            dist.recv(into, peer, group=group)
        else:
            dist.recv(into, peer, group=group)
            dist.send(out, peer, group=group)
        sync()
        return bool((into == float(peer + 1)).all())

    while True:
        cmd, arg = conn.recv()
        try:
            start = time.perf_counter()
            if cmd == "report":
                result: Any = _own_sockets()
            elif cmd == "all_reduce":
                result = all(all_reduce(n, groups[arg[0]]) for n in arg[1])
            elif cmd == "p2p":
                result = all(p2p(n, groups[arg[0]]) for n in arg[1])
            elif cmd == "new_group":
                groups["new"] = dist.new_group([0, 1], timeout=timedelta(seconds=REPLY_S))
                result = all_reduce(4096, groups["new"]) and p2p(4096, groups["new"])
            elif cmd == "guard":
                sys.path[:0] = [str(p) for p in Path(arg).glob("packages/*/src")]
                from opweave.runtime._private.proc import refuse_new_connections

                result = refuse_new_connections()
            elif cmd == "exit":
                dist.destroy_process_group()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
            conn.send(("ok", {"result": result, "s": round(time.perf_counter() - start, 3)}))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Hung(Exception):
    """A rank did not answer in time; the scenario stops there."""


class Pair:
    """Two rank processes and their command pipes."""

    def __init__(self, device: str, env: dict[str, str], folder: Path) -> None:
        ctx = mp.get_context("spawn")
        init_file = folder / f"rendezvous-{time.monotonic_ns()}"
        self.pipes, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            rank_env = {**env, "NCCL_HOSTID": f"opweave-probe-host-{rank}"}
            proc = ctx.Process(target=_rank, args=(rank, str(init_file), device, rank_env, child))
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.init = self._answers()

    def _answers(self) -> list[Any]:
        out = []
        deadline = time.monotonic() + REPLY_S
        for pipe in self.pipes:
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                out.append({"hung": f"no answer within {REPLY_S:.0f} s"})
                continue
            status, value = pipe.recv()
            out.append(value if status == "ok" else {"error": value})
        if any("hung" in a for a in out):
            raise Hung(out)
        return out

    def call(self, cmd: str, arg: Any = None) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((cmd, arg))
        return self._answers()

    def close(self, hung: bool) -> None:
        if not hung:
            with contextlib.suppress(Exception):
                self.call("exit")
        for proc in self.procs:
            proc.join(0 if hung else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _ok(answers: list[Any]) -> bool:
    return all(isinstance(a, dict) and a.get("result") for a in answers)


def scenario(
    name: str, device: str, repo: Path, folder: Path, found: dict[str, Any], save: Any
) -> None:
    """Run scenario ``name``, recording every phase in ``found`` and saving after each."""
    env = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    guarded = name == "guarded"
    if guarded:
        env["NCCL_RUNTIME_CONNECT"] = "0"
    found["ok"] = {}
    start = time.perf_counter()
    phase = "init"
    pair: Pair | None = None

    def step(label: str, cmd: str, arg: Any = None, check: bool = False) -> list[Any]:
        nonlocal phase
        phase = label
        assert pair is not None
        found[label] = pair.call(cmd, arg)
        if check:
            found["ok"][label] = _ok(found[label])
        found["at_s"] = round(time.perf_counter() - start, 1)
        save()
        return found[label]

    try:
        pair = Pair(device, env, folder)
        found["init"] = pair.init
        step("after_init", "report")
        step("warm_all_reduce", "all_reduce", ["world", [4096]], check=True)
        step("warm_p2p", "p2p", ["world", [4096]], check=True)
        warm = step("after_warm_up", "report")
        if guarded:
            step("guard_ports", "guard", str(repo))
        ports = sorted({(a, p) for r in warm for a, p in r["result"]["listen"]})
        phase = "flood"
        found["flood"] = flood(ports, FLOOD_S)
        if guarded:
            found["ok"]["flood_refused"] = all(f["made"] == 0 for f in found["flood"])
        step("after_flood", "report")
        step("all_reduce_after_flood", "all_reduce", ["world", [4096]], check=True)
        step("p2p_after_flood", "p2p", ["world", [4096]], check=True)
        if guarded:
            step("all_reduce_sizes", "all_reduce", ["world", list(SIZES)], check=True)
            step("p2p_sizes", "p2p", ["world", list(SIZES)], check=True)
        held = hold(ports, HOLD)
        try:
            time.sleep(0.5)
            found["held"] = len(held)
            # what is found, not a check: NCCL makes a new communicator through the ranks'
            # listening ports, so held connections (default) or the guard stall it
            step("new_group_while_held", "new_group")
            step("after_hold", "report")
        finally:
            for sock in held:
                sock.close()
        step("after_release", "report")
    except Hung:
        if phase in found["ok"]:
            found["ok"][phase] = False
        found["hung_in"] = phase
    finally:
        if pair is not None:
            pair.close("hung_in" in found)
    found["wall_s"] = round(time.perf_counter() - start, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[2]
    results = []
    with tempfile.TemporaryDirectory(prefix="opweave-nccl-probe-") as tmp:

        def save() -> None:
            args.out.write_text(json.dumps(results, indent=1) + "\n")

        for name in ("guarded", "default"):
            found: dict[str, Any] = {"scenario": name}
            results.append(found)
            try:
                scenario(name, args.device, repo, Path(tmp), found, save)
            except Exception as exc:
                found["error"] = f"{type(exc).__name__}: {exc}"
            save()
            print(json.dumps({k: found.get(k) for k in ("scenario", "ok", "hung_in", "wall_s")}))
    guarded = results[0].get("ok", {})
    return 0 if guarded and all(guarded.values()) and "error" not in results[0] else 1


if __name__ == "__main__":
    sys.exit(main())
