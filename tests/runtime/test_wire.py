"""The CPU point-to-point wire: ordering, big messages both ways at once, a peer that dies,
a peer without the run's secret, waiting spinning or blocked."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta
from hashlib import sha256

import pytest
import torch

from tests.helpers import free_port, join_gloo_pair

KEY = bytes(range(32))


def _rank(rank: int, port: int, scenario: str, spin_s: float, out: mp.Queue) -> None:
    from opweave.runtime import BatchMeta, TokenBatch, unpack
    from opweave.runtime.transport import Message, PeerError, Transport

    join_gloo_pair(rank, port)
    key = KEY if scenario != "impostor" or rank == 0 else b"not the run's secret"
    peer = 1 - rank
    if scenario == "impostor":
        try:
            Transport(rank, torch.device("cpu"), timeout_s=3.0, key=key)
            out.put((rank, "connected"))
        except PeerError as exc:
            out.put((rank, f"{exc.peer}|{exc}"))
        out.close()
        out.join_thread()
        os._exit(0)
    tr = Transport(rank, torch.device("cpu"), timeout_s=10.0, key=key, spin_s=spin_s)
    assert tr.native is not None and tr.spin_s == spin_s  # CPU ranks: the native wire
    if scenario == "both_ways":
        # 32 MB each way before either side receives: far beyond the sockets' buffers, so a
        # transport that blocked in send would deadlock here
        big = torch.arange(8 << 20, dtype=torch.float32) + rank
        for i in range(3):
            batch = TokenBatch(BatchMeta((f"r{i}",), (1,), (0,)), {"hidden": big + i})
            tr.send(Message(peer, range(1), 7), batch, epoch=i)
        got = [unpack(tr.recv(Message(peer, range(1), 7), "receiving")) for _ in range(3)]
        tr.flush()
        ok = all(
            g.meta.request_ids == (f"r{i}",) and torch.equal(g["hidden"], big - rank + peer + i)
            for i, g in enumerate(got)
        )
        out.put((rank, ok))
    elif scenario == "peer_dies":
        if rank == 1:
            os._exit(0)  # without a word
        try:
            tr.recv(Message(peer, range(1), 1), "waiting for rank 1")
            out.put((rank, "no error"))
        except PeerError as exc:
            out.put((rank, f"{exc.peer}|{exc}"))
    out.close()
    out.join_thread()  # flush the queue's feeder thread before the hard exit
    os._exit(0)


def _run(scenario: str, spin_s: float = 0.0) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, scenario, spin_s, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    expected = 1 if scenario == "peer_dies" else 2
    for _ in range(expected):
        rank, value = out.get(timeout=300)  # only against a hang (a busy machine: minutes)
        results[rank] = value
    for p in procs:
        p.join(30)
        assert not p.is_alive()
    return results


@pytest.mark.parametrize("spin_s", [0.0, 0.5], ids=["blocking", "spinning"])
def test_big_messages_both_ways_arrive_whole_and_in_order(spin_s) -> None:
    assert _run("both_ways", spin_s) == {0: True, 1: True}


@pytest.mark.parametrize("spin_s", [0.0, 30.0], ids=["blocking", "spinning"])
def test_a_peer_that_exits_fails_the_wait_at_once_naming_it(spin_s) -> None:
    """The wait ends on the lost connection, not on the 10 s timeout, whose error would say
    "timed out after 10 s" (how soon it ends: tools/bench/faults.py)."""
    peer, message = str(_run("peer_dies", spin_s)[0]).split("|")
    assert peer == "1"
    assert "lost rank 1 while waiting for rank 1" in message


def test_a_peer_without_the_runs_secret_is_refused() -> None:
    results = _run("impostor")
    peer, message = str(results[1]).split("|")
    assert peer == "0" and "refused the connection" in message  # the impostor learns nothing
    # rank 0 waits out its 3 s join timeout for a rank with the secret (how long that takes:
    # tools/bench/faults.py)
    peer, message = str(results[0]).split("|")
    assert peer == "1" and "timed out waiting for ranks [1] to connect" in message


def test_ranks_spin_only_on_a_core_of_their_own_unless_told() -> None:
    """How a rank waits is a run option (``wait``, ``opweave run --wait``); no environment
    variable changes it."""
    from opweave.runtime import RunOptions
    from opweave.runtime._private.options import SPIN_S

    assert RunOptions().spin_s(own_core=True) == SPIN_S > 0
    assert RunOptions().spin_s(own_core=False) == 0.0
    assert RunOptions(wait="block").spin_s(own_core=True) == 0.0
    assert RunOptions(wait="spin").spin_s(own_core=False) == SPIN_S
    with pytest.raises(ValueError, match="auto"):
        RunOptions(wait="poll")


def test_the_rendezvous_store_listens_on_the_master_address_only() -> None:
    """torch's TCPStore would listen on every interface; node 0 hands it a socket bound to
    the master address."""
    from opweave.runtime._private.nodes import host_store
    from tests.helpers import listening

    port = free_port()
    store = host_store("127.0.0.1", port, 10.0)
    store.set("key", "value")
    assert store.get("key") == b"value"
    on_port = [addr for addr, p, _ in listening([os.getpid()]) if p == port]
    assert on_port == ["127.0.0.1"], on_port


def test_an_outsider_on_the_rendezvous_store_cannot_find_the_runs_keys(
    tiny_model, monkeypatch
) -> None:
    """Every key a run writes to its TCP store lies under a prefix derived from the run's secret:
    a process that reaches the store's port without the secret finds none of them (here: the
    driver's control address, while node 0 waits for a node 1 that never comes)."""
    import threading

    import torch.distributed as dist

    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Cluster, RunFailedError, RunOptions, Topology
    from opweave.runtime._private.control import store_namespace
    from opweave.runtime._private.join import CONTROL_KEY

    monkeypatch.setenv("OPWEAVE_RUN_SECRET", "only the run knows")
    model_dir = tiny_model("llama")
    spec = load_model(model_dir)
    plan = canonical_plan(spec, "afd", gpu="cpu", batch=2)
    port = free_port()
    failed: list[BaseException] = []

    def node0() -> None:
        try:
            options = RunOptions(join_timeout_s=10)
            Cluster(plan, spec, model_dir, options, topology=Topology(nnodes=2, master_port=port))
        except BaseException as exc:
            failed.append(exc)

    starting = threading.Thread(target=node0)
    starting.start()
    try:
        outsider = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, None, False, timeout=timedelta(seconds=15)
        )
        secret_key = f"{store_namespace(sha256(b'only the run knows').digest())}/{CONTROL_KEY}"
        deadline = time.monotonic() + 15
        while not outsider.check([secret_key]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert outsider.check([secret_key])  # the run published its address, under its prefix
        assert not outsider.check([CONTROL_KEY])  # and nothing where a guess would look
        assert outsider.num_keys() >= 1
    finally:
        starting.join()
    assert len(failed) == 1 and isinstance(failed[0], RunFailedError), failed  # node 1 never came


def test_node_zero_names_only_nodes_from_the_public_key_of_other_secrets(capsys):
    """The key nodes with another secret write is public, so anyone reaching the store can
    write it: node 0 says only a node's or rank's name from it, once each."""
    from types import SimpleNamespace

    from opweave.runtime._private.cluster import Cluster
    from opweave.runtime._private.nodes import OTHER_SECRET_KEY

    class Store:
        value = b"node 1;\x1b[2Jnode 9;node 1;rank 3;node 2; and more"

        def check(self, keys: list[str]) -> bool:
            return keys == [OTHER_SECRET_KEY]

        def get(self, key: str) -> bytes:
            return self.value

    told = SimpleNamespace(_public_store=Store(), _other_secrets=set())
    Cluster._tell_other_secrets(told)  # pyright: ignore[reportArgumentType]
    Cluster._tell_other_secrets(told)  # pyright: ignore[reportArgumentType]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" was started")[0] for line in lines] == [
        "warning: node 1",
        "warning: rank 3",
        "warning: node 2",
    ]
    assert lines[0] == (
        "warning: node 1 was started with another OPWEAVE_RUN_SECRET and cannot join; start it "
        "again with this node's value"
    )
