"""Rank programs: a CPU rank's decode iteration as one call, over the native wire.

The wire's operators are checked in one process over a socket pair (what crosses, in order,
however large; what a peer that closes, hangs or sends out of schedule gets; that a compiled
graph calls them natively and its errors keep their text), then whole plans: tokens, and one
native call per decode iteration.
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import Request, RunOptions, compile_schedule, run_plan
from opweave.runtime._private.native import NativeWire
from opweave.runtime._private.placement import Placement
from opweave.runtime.transport import PeerError

MAX_NEW_TOKENS = 10


@pytest.fixture
def pair():
    """Two native wires joined by a socket pair: rank 0's and rank 1's."""
    a, b = socket.socketpair()
    wires = NativeWire({1: a}, timeout_s=2.0, spin_s=0.0), NativeWire({0: b}, 2.0, 0.0)
    yield wires
    for w in wires:
        w.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_messages_arrive_whole_and_in_order_however_large(pair):
    """80 MB go out before the peer reads anything: far beyond the socket's buffer, so a send
    that blocked would never return (here: the sending thread would still be in it a minute
    later); the writer thread delivers the rest."""
    zero, one = pair
    big = torch.arange(20 << 20, dtype=torch.float32)
    small = torch.tensor([3, 1, 4], dtype=torch.int64)

    def send_both() -> None:
        zero.send(1, 5, [_bytes(big)], zero.ones)
        zero.send(1, 6, [_bytes(small), _bytes(small + 1)], zero.ones)

    sender = threading.Thread(target=send_both, daemon=True)
    sender.start()
    sender.join(60)  # only against a hang: returning takes milliseconds (tools/bench/faults.py)
    assert not sender.is_alive(), "a send waited for the reader"
    got = one.recv(0, 5, big.numel() * 4, "receiving the big one")
    assert torch.equal(got.view(torch.float32), big)
    got = one.recv(0, 6, 48, "receiving the small one").view(torch.int64)
    assert got.tolist() == [3, 1, 4, 4, 2, 5]
    zero.drain()
    _, sent, messages = zero.stats()
    assert (sent, messages) == (big.numel() * 4 + 48, 2)


def test_a_message_out_of_schedule_names_the_peer(pair):
    zero, one = pair
    zero.send(1, 7, [_bytes(torch.zeros(4))], zero.ones)
    with pytest.raises(
        PeerError,
        match=r"rank 0 sent message 7 \(16 bytes\) while message 8 "
        r"\(16 bytes\) was expected: schedules differ",
    ) as info:
        one.recv(0, 8, 16, "receiving segment 2 microbatch 0")
    assert info.value.peer == 0


def test_a_peer_that_closes_or_hangs_fails_the_receive_naming_it(pair):
    zero, one = pair
    # the receive gives up on its own 2 s timeout (how close to 2 s: tools/bench/faults.py)
    with pytest.raises(
        PeerError,
        match=r"timed out after 2 s receiving segment 1 microbatch 0 "
        r"\(rank 0\)",
    ):
        one.recv(0, 1, 8, "receiving segment 1 microbatch 0")
    zero.close()
    with pytest.raises(
        PeerError,
        match="lost rank 0 while receiving segment 3 microbatch 1: it closed its connection",
    ) as info:
        one.recv(0, 4, 8, "receiving segment 3 microbatch 1")
    assert info.value.peer == 0


def test_a_dry_wire_neither_sends_nor_waits(pair):
    """A program's warm-up runs with its wire dry: nothing goes out, receives return zeros."""
    zero, one = pair
    zero.dry(True)
    zero.send(1, 2, [_bytes(torch.ones(2))], zero.ones)
    assert zero.recv(1, 2, 8, "receiving").tolist() == [0] * 8
    zero.dry(False)
    zero.send(1, 3, [_bytes(torch.ones(2))], zero.ones)
    assert one.recv(0, 3, 8, "receiving").view(torch.float32).tolist() == [1.0, 1.0]


def _plan(model_dir, strategy, *, tp=1, replicas=1, microbatches=2):
    plan = canonical_plan(load_model(model_dir), strategy, gpu="cpu", batch=4, microbatches=2)
    owners = [
        ow.model_copy(update={"tp": tp, "replicas": replicas, "resident_batch": 4 // replicas})
        if i == 0
        else ow
        for i, ow in enumerate(plan.owners)
    ]
    return plan.model_copy(update={"owners": tuple(owners), "microbatches": microbatches})


@pytest.mark.parametrize(
    ("family", "strategy", "tp", "replicas", "decode_step"),
    [
        ("llama", "afd", 1, 1, "compiled"),  # inductor's C++ wrapper: one native call
        ("qwen3_next", "cad", 2, 1, "traced"),  # linear attention, a TP group's broadcast
        ("qwen3_moe", "afd", 1, 2, "traced"),  # two attention replicas, MoE experts
    ],
)
def test_a_decode_iteration_is_one_program_and_tokens_are_transformers(
    family, strategy, tp, replicas, decode_step, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model(family)
    plan = _plan(model_dir, strategy, tp=tp, replicas=replicas)
    requests = [Request(tuple(p), MAX_NEW_TOKENS, stop_token_ids=()) for p in prompts]

    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=300, decode_step=decode_step))

    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    placement = Placement(plan, load_model(model_dir))
    for r in result.ranks:
        assert r.traffic_compiles == 0
        if decode_step != "compiled":
            continue
        # every decode iteration is one call; the prefill iteration launches each operator of
        # each action (an iteration after a microbatch's last one runs its actions one at a
        # time, and here has no requests: it launches nothing and is no decode iteration)
        assert r.submissions_per_token == 1
        assert MAX_NEW_TOKENS - 2 <= r.decode_iterations <= r.iterations - 1
        prefill = sum(len(a.ops) for a in compile_schedule(placement, r.rank))
        assert r.submissions == prefill + r.decode_iterations


def test_a_compiled_program_calls_the_wire_without_python(pair):
    """Inductor's C++ wrapper reaches the wire's operators through the dispatcher, not through
    a Python callback (which it takes for schemas it cannot pass natively): the program has no
    Python between its actions. What the graph sends arrives, and what it receives comes out."""
    from torch._inductor.utils import run_and_get_code

    zero, one = pair

    def iteration(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        x = torch.ops.opweave.after(x, token)
        token = torch.ops.opweave.send(_bytes(x * 2), token, token, zero.id, 1, 3)
        raw = torch.ops.opweave.recv(token, zero.id, 1, 4, 16)
        return raw.view(torch.float32) + x

    compiled = torch.compile(iteration, fullgraph=True, options={"cpp_wrapper": True})
    one.send(0, 4, [_bytes(torch.full((4,), 10.0))], one.ones)
    x = torch.arange(4, dtype=torch.float32)
    with torch.inference_mode():
        out, codes = run_and_get_code(compiled, x, torch.ones(1, dtype=torch.int64))
    assert out.tolist() == [10.0, 11.0, 12.0, 13.0]
    assert one.recv(0, 3, 16, "receiving").view(torch.float32).tolist() == [0.0, 2.0, 4.0, 6.0]
    code = "\n".join(codes)
    for op in ("after", "send", "recv"):
        assert f'aoti_torch_call_dispatcher("opweave::{op}"' in code
    assert "custom_op_wrapper" not in code


def test_an_error_inside_a_compiled_program_keeps_its_text(pair):
    """The compiled wrapper reports a failed operator in words of its own; the peer and what
    was being received come back from the extension."""
    from opweave.runtime._private.native import translate

    zero, _ = pair

    def iteration(token: torch.Tensor) -> torch.Tensor:
        return torch.ops.opweave.recv(token, zero.id, 1, 6, 8) + 1

    compiled = torch.compile(iteration, fullgraph=True, options={"cpp_wrapper": True})
    with torch.inference_mode(), pytest.raises(RuntimeError) as info:
        compiled(torch.ones(1, dtype=torch.int64))
    error = translate(info.value, {6: "receiving segment 3 microbatch 0"})
    assert isinstance(error, PeerError) and error.peer == 1
    assert str(error) == "timed out after 2 s receiving segment 3 microbatch 0 (rank 1)"
