"""The static-shape decode step: one traceable graph per segment, tokens still transformers'."""

from __future__ import annotations

import pytest
import torch

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import (
    TINY_CONFIGS,
    BatchMeta,
    LocalModel,
    Request,
    RunOptions,
    StageModule,
    TokenBatch,
    operator_sequence,
    run_plan,
)
from opweave.runtime._private.decode import (
    StaticStep,
    _distrust_graphs,
    compiled_graphs,
    trust_warm_graphs,
)

MAX_NEW_TOKENS = 12


def _cut_after_attention(model_dir) -> list[int]:
    """Cuts that put layer 0's core_attn in a segment of its own, as CAD does: segments then
    begin and end at q/k/v, at attention's output and mid-layer."""
    seq = operator_sequence(model_dir)
    attn = next(i for i, ref in enumerate(seq) if ref[1] == "core_attn")
    return [attn, attn + 1]


# glm4_moe_lite's operators are deepseek_v3's (MLA) with glm4_moe's router, both traced here
@pytest.mark.parametrize("family", tuple(f for f in TINY_CONFIGS if f != "glm4_moe_lite"))
def test_every_segments_decode_step_traces_as_one_graph(family, tiny_model, hf_greedy, prompts):
    """torch.compile(fullgraph=True) of each segment's decode step (a graph break would raise),
    and the traced steps' greedy tokens equal transformers'."""
    model_dir = tiny_model(family)
    cuts = _cut_after_attention(model_dir)
    model = LocalModel(model_dir, cuts=cuts, decode_step="traced", max_running=len(prompts))

    ours = model.generate(prompts, MAX_NEW_TOKENS)

    assert ours == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert model.module.static_decode == "aot_eager"  # every segment's decode ran traced
    steps = model.module._steps
    assert {(seg.start, seg.stop) for seg in model.segments} == {k[:2] for k in steps}
    assert all(key[2] == len(prompts) for key in steps)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_trusted_steps_of_several_segments_keep_their_own_graphs(
    family, tiny_model, hf_greedy, prompts
):
    """After the warm-up a rank checks only the guards that tell its steps apart
    (``trust_warm_graphs``). Three segments' steps share one traced function: each must still
    run its own graph (no other segment's, no new one), over longer contexts and grown slabs
    than it was compiled with, and the tokens stay transformers'."""
    model_dir = tiny_model(family)
    cuts = _cut_after_attention(model_dir)
    model = LocalModel(model_dir, cuts=cuts, decode_step="traced", max_running=len(prompts))
    model.generate([p[:3] for p in prompts], 3)  # the warm-up: compiles each segment's step
    graphs = compiled_graphs()
    try:
        trust_warm_graphs()
        ours = model.generate(prompts, MAX_NEW_TOKENS)
    finally:
        _distrust_graphs()

    assert ours == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert compiled_graphs() == graphs
    assert len(model.segments) == len(model.module._steps) == 3  # one step per segment


def test_a_step_built_after_the_warm_up_turns_the_full_guards_back_on(
    tiny_model, hf_greedy, prompts
):
    """Trusting the warm-up's graphs is for a process that builds no step after it: one built
    later (here: a second model, whose steps share the traced function) gets every guard again,
    so it compiles its own graph rather than running another's."""
    first, second = tiny_model("llama"), tiny_model("qwen3_next")
    model = LocalModel(first, decode_step="traced", max_running=len(prompts))
    model.generate([p[:3] for p in prompts], 3)
    try:
        trust_warm_graphs()
        late = LocalModel(second, decode_step="traced", max_running=len(prompts))
        ours = late.generate(prompts, MAX_NEW_TOKENS)
        from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

        assert not _is_skip_guard_eval_unsafe_stance()
    finally:
        _distrust_graphs()
    assert ours == hf_greedy(second, prompts, MAX_NEW_TOKENS)


def test_a_trusted_step_given_inputs_it_was_not_compiled_for_compiles_them(tiny_model, capsys):
    """A trusted rank still checks each input's dtype and shape: a step fed token ids of
    another dtype than at its warm-up compiles a graph for them (counted, as a rank's
    ``traffic_compiles`` counts it), rather than failing the rank, and trusts again after."""
    from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

    stage = StageModule.whole_model(tiny_model("llama"))
    stage.use_static_decode(compile="aot_eager")
    prompt = torch.tensor([5, 6, 7])
    for rid in ("a", "b", "c"):  # requests in the same state
        stage.admit(rid)
        stage(TokenBatch(BatchMeta((rid,), (3,), (0,)), {"token_ids": prompt}))

    def decode(rid: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        ids = torch.tensor([8], dtype=dtype)
        return stage.run(TokenBatch(BatchMeta((rid,), (1,), (3,)), {"token_ids": ids})).tensors

    warm = decode("a", torch.int64)  # the warm-up compiles the int64 step
    graphs = compiled_graphs()
    try:
        trust_warm_graphs()
        late = decode("b", torch.int32)
        assert _is_skip_guard_eval_unsafe_stance()
        again = decode("c", torch.int32)  # the new graph, found under trust
    finally:
        _distrust_graphs()

    assert compiled_graphs() == graphs + 1
    said = capsys.readouterr().err
    assert said.count("met inputs its warm-up did not compile it for (token_ids int32[1])") == 1
    assert warm.keys() == late.keys()
    for name in warm:
        torch.testing.assert_close(late[name], warm[name])
        torch.testing.assert_close(again[name], warm[name])


def test_a_graph_break_in_a_step_is_an_error(tiny_model, monkeypatch):
    """fullgraph: an operator that reads a tensor back to the host fails the trace, rather than
    silently splitting the step into several programs."""
    from opweave.runtime._private.ops import FinalNorm

    model_dir = tiny_model("llama")
    stage = StageModule.whole_model(model_dir)
    stage.use_static_decode(compile="aot_eager")
    norm = next(op for op in stage.operators if isinstance(op, FinalNorm))
    forward = norm.forward

    def host_sync(batch):
        if float(batch["hidden"].sum()) > 1e30:  # .item(): a host synchronisation
            raise AssertionError
        return forward(batch)

    # on the instance: a graph another test built for this model's step (the class's own
    # methods are not among a graph's guards) does not match it
    monkeypatch.setattr(norm, "forward", host_sync)
    stage.admit("a")
    stage(TokenBatch(BatchMeta(("a",), (3,), (0,)), {"token_ids": torch.tensor([5, 6, 7])}))
    with pytest.raises(Exception, match="(?i)graph break|unsupported|data-dependent|item"):
        stage.run(TokenBatch(BatchMeta(("a",), (1,), (3,)), {"token_ids": torch.tensor([8])}))


@pytest.mark.parametrize(
    ("family", "reserved", "state_rows"),
    [
        ("llama", 4, [3, 0, 1]),
        ("gemma3_text", 4, [3, 0, 1]),
        ("qwen3_next", 4, [3, 0, 1]),
        ("mixtral", 4, [3, 0, 1]),
        # nothing reserved, and the request left out holds the row after the step's rows: the
        # padding must still write past every held row
        ("llama", 0, [0, 2, 1]),
        ("qwen3_next", 0, [0, 2, 1]),
    ],
)
def test_padding_rows_leave_requests_outside_the_step_intact(
    family, reserved, state_rows, tiny_model
):
    """A rank's step has a row per slot: requests sit at their slot's row, empty rows pad, and
    a held request that is not in a step (its row padded) continues as if never touched."""
    model_dir = tiny_model(family)
    plain, static = StageModule.whole_model(model_dir), StageModule.whole_model(model_dir)
    static.use_static_decode(rows=reserved, tokens=8)  # slabs smaller than the contexts
    rids, prompts = ("a", "b", "c"), ([5, 6, 7], list(range(10, 21)), [9, 4])
    last: dict[str, dict[str, int]] = {"plain": {}, "static": {}}
    ctx = {rid: len(p) for rid, p in zip(rids, prompts, strict=True)}
    for name, stage in (("plain", plain), ("static", static)):
        stage.admit(list(rids), rows=state_rows)
        for rid, p in zip(rids, prompts, strict=True):
            meta = BatchMeta((rid,), (len(p),), (0,))
            last[name][rid] = int(
                stage(TokenBatch(meta, {"token_ids": torch.tensor(p)}))["token_ids"][0]
            )

    def decode(stage: StageModule, name: str, who: tuple[str, ...], rows: list[int]) -> None:
        meta = BatchMeta(who, (1,) * len(who), tuple(ctx[r] for r in who))
        ids = torch.tensor([last[name][r] for r in who])
        out = stage.run(TokenBatch(meta, {"token_ids": ids}), size=4, place=rows)
        last[name].update(zip(who, out["token_ids"].tolist(), strict=True))

    schedule = [(("a", "c"), [3, 1])] * 6 + [(("b",), [0])] * 3 + [(rids, [3, 0, 1])] * 12
    for who, rows in schedule:
        decode(plain, "plain", who, rows)
        decode(static, "static", who, rows)
        assert last["static"] == last["plain"], who
        for r in who:
            ctx[r] += 1
    assert len(static._steps) == 1  # one step of 4 rows served every schedule
    # run eagerly, a static step still launches its operators one by one
    assert (
        static.submissions
        == plain.submissions
        == (len(rids) + len(schedule)) * len(static.operators)
    )


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_state_that_outgrows_its_slab_row_between_steps_moves_back_in(family, tiny_model):
    """A request decodes in the static step, then in mixed batches (a prefill beside it runs
    the per-request operators) until its keys outgrow their slab row, then statically again:
    its state is copied back into its row, and every token equals a stage without slabs."""
    model_dir = tiny_model(family)
    plain, static = StageModule.whole_model(model_dir), StageModule.whole_model(model_dir)
    static.use_static_decode(rows=2, tokens=4)  # slabs far shorter than the context
    last: dict[str, list[int]] = {"plain": [], "static": []}
    ctx = {"a": 0, "p": 0}
    prompt = list(range(10, 20))

    def step(who: tuple[str, ...], queries: tuple[int, ...], ids: dict[str, list[int]]) -> None:
        meta = BatchMeta(who, queries, tuple(ctx[r] for r in who))
        for name, stage in (("plain", plain), ("static", static)):
            tokens = [t for r in who for t in (ids[r] if r != "a" else ids[r] or last[name][-1:])]
            out = stage.run(TokenBatch(meta, {"token_ids": torch.tensor(tokens)}), size=2)
            last[name].append(int(out["token_ids"][0]))
        for r, q in zip(who, queries, strict=True):
            ctx[r] += q

    for stage in (plain, static):
        stage.admit(["a", "p"], rows=[0, 1])
    step(("a",), (len(prompt),), {"a": prompt})
    for _ in range(3):  # static steps: a's state moves into its slab row
        step(("a",), (1,), {"a": []})
    for i in range(12):  # mixed: per-request operators, past the slab row's length
        step(("a", "p"), (1, 2), {"a": [], "p": [30 + 2 * i, 31 + 2 * i]})
    stateful = [op for op in static.operators if hasattr(op, "_outside")]
    assert any("a" in op._outside for op in stateful)  # its keys left the slab row
    for _ in range(4):  # static again: moved back in
        step(("a", "p"), (1, 1), {"a": [], "p": [7]})
    assert last["static"] == last["plain"]
    assert not any(op._outside for op in stateful)  # every state back in its row


def test_a_step_whose_context_disagrees_with_the_state_is_an_error(tiny_model):
    stage = StageModule.whole_model(tiny_model("llama"))
    stage.use_static_decode(rows=1, tokens=8)
    stage.admit("a")
    stage(TokenBatch(BatchMeta(("a",), (3,), (0,)), {"token_ids": torch.tensor([5, 6, 7])}))
    with pytest.raises(Exception, match="request 'a': layer 0 holds 3 tokens, batch says 4"):
        stage.run(TokenBatch(BatchMeta(("a",), (1,), (4,)), {"token_ids": torch.tensor([8])}))
    with pytest.raises(Exception, match="request 'b' is not admitted on layer 0"):
        stage.run(TokenBatch(BatchMeta(("b",), (1,), (3,)), {"token_ids": torch.tensor([8])}))


def test_a_step_refuses_a_row_outside_it(tiny_model):
    stage = StageModule.whole_model(tiny_model("llama"))
    step = StaticStep(stage.operators, None, 2)
    stage.admit("a")
    with pytest.raises(Exception, match="cannot place rows"):
        step(TokenBatch(BatchMeta(("a",), (1,), (1,)), {"token_ids": torch.tensor([1])}), [2])


@pytest.mark.parametrize(
    ("strategy", "tp", "replicas", "decode_step"),
    [
        ("colocated", 1, 1, "compiled"),
        ("colocated", 2, 1, "traced"),
        ("cad", 2, 2, "static"),
        ("afd", 1, 1, "traced"),
    ],
)
def test_plans_serve_the_same_tokens_with_static_steps(
    strategy, tp, replicas, decode_step, tiny_model
):
    """Over rank processes (TP all-reduces inside the traced graph, replicas, microbatches, a
    rank's slots padding its step) the tokens equal the per-request runtime's; each rank says how
    it ran, and a compiled step is one launch per segment and token."""
    model_dir = tiny_model("qwen3")
    spec = load_model(model_dir)
    plan = canonical_plan(spec, strategy, gpu="cpu", batch=4, microbatches=2)
    owners = [
        ow.model_copy(update={"tp": tp, "replicas": replicas, "resident_batch": 4 // replicas})
        for ow in plan.owners
    ]
    plan = plan.model_copy(update={"owners": tuple(owners)})
    requests = [Request(tuple(range(5, 8 + 3 * i)), MAX_NEW_TOKENS) for i in range(3)]

    base = run_plan(plan, model_dir, requests, RunOptions(timeout_s=300, device="cpu"))
    static = run_plan(
        plan, model_dir, requests, RunOptions(timeout_s=300, device="cpu", decode_step=decode_step)
    )
    assert base is not None and static is not None

    assert [o.token_ids for o in static.outputs] == [o.token_ids for o in base.outputs]
    # the driver ran ahead of static steps (the ranks kept their tokens), never of the others
    assert static.driver.works_ahead > 0 and base.driver.works_ahead == 0
    for before, after in zip(base.ranks, static.ranks, strict=True):
        assert (before.decode_step, after.decode_step) == ("per-request", decode_step)
        assert after.host_s_per_token >= 0
        # every static step is built at the warm-up (a compiled one compiled), none by traffic
        assert after.warm_up_s > 0 and after.traffic_compiles == 0
        if decode_step != "compiled":  # the operators still launch one by one
            assert after.submissions_per_token == before.submissions_per_token
            continue
        # the prefill iteration launches every operator of every action (microbatch), each of
        # the decode iterations after it one rank program
        per_iteration = after.computes_per_iteration * len(operator_sequence(model_dir))
        assert before.submissions_per_token == per_iteration
        assert before.decode_iterations == after.decode_iterations == MAX_NEW_TOKENS - 1
        assert after.submissions_per_token == 1
        assert after.submissions == per_iteration + after.decode_iterations


@pytest.mark.parametrize("decode_step", ["static", "traced"])
def test_static_steps_send_their_rows_and_nothing_else(decode_step, tiny_model):
    """In a decode iteration of static steps a message is the link's rows of what crosses the
    cut, padding rows included, with no header. In this AFD plan (4 slots, 2 microbatches, 3
    requests) only the hidden state crosses each cut: per iteration the attention rank sends
    every layer's rows of the 4 slots to the FFN rank, which sends one layer fewer back, and its
    last segment's tokens (an int64 per slot) to the attention rank, which embeds them in the
    next iteration; so 5 more tokens cost exactly 5 times that. Traced steps run as rank
    programs, whose messages cross the native wire: the same rows (its frame header is not
    counted)."""
    model_dir = tiny_model("llama")
    spec = load_model(model_dir)
    plan = canonical_plan(spec, "afd", gpu="cpu", batch=4, microbatches=2)
    prompts = [tuple(range(5, 8 + 3 * i)) for i in range(3)]

    def run(tokens: int):
        requests = [Request(p, tokens, stop_token_ids=()) for p in prompts]  # no early stop
        result = run_plan(
            plan,
            model_dir,
            requests,
            RunOptions(timeout_s=300, device="cpu", dtype="float32", decode_step=decode_step),
        )
        assert result is not None
        assert [len(o.token_ids) for o in result.outputs] == [tokens] * 3
        return result

    short, long = run(4), run(9)
    row = spec.hidden_size * 4  # one float32 hidden state
    layers = spec.num_layers
    attention = next(r for r in long.ranks if r.stages[0].startswith("embed.."))
    ffn = next(r for r in long.ranks if r.rank != attention.rank)
    sent = {r.rank: r.bytes_sent for r in long.ranks}
    before = {r.rank: r.bytes_sent for r in short.ranks}
    assert sent[attention.rank] - before[attention.rank] == 5 * layers * 4 * row
    assert sent[ffn.rank] - before[ffn.rank] == 5 * ((layers - 1) * 4 * row + 4 * 8)
