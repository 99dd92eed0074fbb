"""The OpWeave executor for vLLM's v1 engine.

vLLM imports happen inside :func:`executor_class` only, so this module imports (and its doctests
collect) without vLLM installed. The class is built once, on first use, and registered as
``opweave.runtime.vllm.OpWeaveExecutor`` so that a dotted name, and pickling the config into
vLLM's engine-core process, both find it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from concurrent.futures import Future
from typing import Any

import torch

PLAN_KEY = "opweave_plan"  # additional_config key: plan file path, or the plan as a JSON dict
DEVICE_KEY = "opweave_device"  # additional_config key: torch device of the stages (default cpu)
WORKERS_KEY = "opweave_workers"  # "processes" (default with a plan) or "inprocess"
TIMEOUT_KEY = "opweave_timeout_s"  # stage workers: longest wait for a step's messages (120 s)
WORKER_MODES = ("processes", "inprocess")

_log = logging.getLogger("opweave.runtime.vllm")
_lock = threading.Lock()
_cls: type | None = None


def executor_class() -> type:
    """``OpWeaveExecutor``, a subclass of ``vllm.v1.executor.abstract.Executor`` (needs vLLM)."""
    global _cls
    with _lock:
        if _cls is None:
            _cls = _build()
    return _cls


def _build() -> type:
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import ModelRunnerOutput

    from ..errors import OpWeaveRuntimeError
    from ._engine import Pipeline, PlanPipeline, StepEngine, WorkItem, sample
    from ._kernels import kernel_choice

    class OpWeaveExecutor(Executor):
        """Runs each engine step through OpWeave's stages, cut by the plan's segments.

        The plan comes through vLLM's own configuration: ``additional_config={"opweave_plan":
        PATH_OR_DICT}`` (``--additional-config`` on vLLM's command line); without one the whole
        model is one stage. The scheduler is capped at the plan's global batch
        (``max_num_seqs``), and the KV capacity reported to it covers that many requests of
        ``max_model_len`` tokens, so vLLM never admits more requests than the plan holds.

        Where the stages run (``additional_config["opweave_workers"]``):

        - ``"processes"`` (the default with a plan): one stage worker process per plan owner
          (:class:`~._workers.WorkerPool`); this process is the driver, which feeds each step's
          tokens to the first segment's worker, gets the last segment's logits back and samples.
          A worker that dies fails the in-flight step, makes :meth:`check_health` raise and tells
          vLLM's engine through its failure callback; :meth:`shutdown` reaps the workers.
        - ``"inprocess"`` (the default without a plan): every segment runs in this process, with
          pack/unpack at segment boundaries (:class:`~._engine.PlanPipeline`); no process to
          lose, useful to debug a plan or where extra processes are unwelcome.
        """

        uses_ray = False
        supports_pp = False

        # -- start-up ------------------------------------------------------------------------
        def _init_executor(self) -> None:
            extra = self.vllm_config.additional_config
            extra = extra if isinstance(extra, dict) else {}
            mc = self.model_config
            if self.speculative_config is not None:
                raise ValueError("the OpWeave executor does not support speculative decoding")
            if self.lora_config is not None:
                raise ValueError("the OpWeave executor does not support LoRA")
            # State lives in OpWeave's operators per request id: a prefix-cache hit would hand
            # us a request whose first tokens no stage holds (they would be recomputed, but
            # there is nothing to gain), so switch it off.
            self.cache_config.enable_prefix_caching = False
            self._failure_callbacks: list[Any] = []
            self.pipeline = self._make_pipeline(extra)
            gb = self.pipeline.global_batch
            if gb is not None and self.scheduler_config.max_num_seqs > gb:
                self.scheduler_config.max_num_seqs = gb
            self.engine = StepEngine(self.pipeline)
            self._pending: tuple[list[str], list[str], torch.Tensor | None] | None = None
            self._warned: set[str] = set()
            self.num_blocks: int | None = None
            _log.info(
                "OpWeave executor: %d segment(s) over %s, %s%s; vLLM kernels: %s",
                self.pipeline.num_segments,
                mc.model,
                self.workers_mode,
                "" if gb is None else f", global batch {gb}",
                ", ".join(k for ks in self.pipeline.kernels for k in ks) or "none",
            )

        def _make_pipeline(self, extra: dict[str, Any]) -> Pipeline:
            plan = extra.get(PLAN_KEY)
            mode = extra.get(WORKERS_KEY) or ("processes" if plan is not None else "inprocess")
            if mode not in WORKER_MODES:
                raise ValueError(
                    f"additional_config {WORKERS_KEY}={mode!r}: expected one of "
                    + ", ".join(WORKER_MODES)
                )
            if mode == "processes" and plan is None:
                raise ValueError(
                    f'{WORKERS_KEY}="processes" needs a plan ({PLAN_KEY}); without one, '
                    'the colocated model runs "inprocess"'
                )
            self.workers_mode: str = mode
            device = str(extra.get(DEVICE_KEY, "cpu"))
            dtype = self.model_config.dtype
            kernels = kernel_choice(extra)  # resolved here: a bad value fails before any worker
            if mode == "inprocess":
                return PlanPipeline(
                    self.model_config.model, plan, dtype=dtype, device=device, kernels=kernels
                )
            from ._workers import WorkerPool

            pool = WorkerPool(
                self.model_config.model,
                plan,
                dtype=dtype,
                device=device,
                timeout_s=float(extra.get(TIMEOUT_KEY, 120.0)),
                kernels=kernels,
            )
            pool.on_failure = self._failure_callbacks  # filled by register_failure_callback
            return pool

        def _block_size(self) -> int:
            return int(self.cache_config.block_size or 16)

        def get_kv_cache_specs(self) -> list[dict[str, Any]]:
            spec = self.pipeline.spec
            one = FullAttentionSpec(
                block_size=self._block_size(),
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_dim,
                dtype=self.pipeline.spec.dtype,
            )
            return [{f"model.layers.{i}.self_attn.attn": one for i in range(spec.num_layers)}]

        def get_supported_kv_cache_layouts(self) -> list[list[str]]:
            return [["LBHNC"]]

        def set_kv_cache_layout(self, layout_name: str) -> None:
            pass  # the stages keep their own per-request state

        def determine_available_memory(self) -> list[int]:
            """Bytes for ``global batch`` requests of ``max_model_len`` tokens in every layer
            (vLLM sizes its block table from this; without a plan, 8 such requests)."""
            spec = self.get_kv_cache_specs()[0]
            one = next(iter(spec.values()))
            per_req_blocks = math.ceil(self.model_config.max_model_len / self._block_size())
            requests = self.pipeline.global_batch or max(8, self.scheduler_config.max_num_seqs)
            return [requests * per_req_blocks * one.page_size_bytes * len(spec)]

        def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
            self.num_blocks = kv_cache_configs[0].num_blocks

        def compile_or_warm_up_model(self) -> None:
            pass

        def register_failure_callback(self, callback: Any) -> None:
            self._failure_callbacks.append(callback)

        # -- the step --------------------------------------------------------------------------
        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            return self._call(self._execute, scheduler_output, non_block=non_block)

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            return self._call(self._sample, grammar_output, non_block=non_block)

        def _call(self, fn: Any, arg: Any, *, non_block: bool) -> Any:
            self.pipeline.check()
            if not non_block:
                return fn(arg)
            future: Future[Any] = Future()
            try:
                future.set_result(fn(arg))
            except Exception as exc:  # surfaced by future.result() in the engine core
                future.set_exception(exc)
            return future

        def _execute(self, so: Any) -> None:
            eng = self.engine
            for rid in so.finished_req_ids:
                eng.drop(rid)
            for rid in so.preempted_req_ids or ():
                if rid in eng.requests:
                    eng.reset_state(rid)
            starts: dict[str, int] = {}
            for new in so.scheduled_new_reqs:
                if new.prompt_token_ids is None:
                    raise ValueError("the OpWeave executor needs prompt token ids (no embeds)")
                eng.add(new.req_id, new.prompt_token_ids, new.sampling_params)
                self._check_params(new.sampling_params)
                starts[new.req_id] = new.num_computed_tokens
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                starts[rid] = cached.num_computed_tokens[i]
                all_ids = getattr(cached, "all_token_ids", None) or {}
                if rid in all_ids:  # a resumed request: vLLM re-sends its tokens
                    req = eng.requests[rid]
                    req.token_ids = list(all_ids[rid])
            order = list(so.num_scheduled_tokens)
            items = [WorkItem(rid, starts[rid], so.num_scheduled_tokens[rid]) for rid in order]
            sampled, logits = eng.run(items)
            self._pending = (order, sampled, logits)

        def _sample(self, grammar_output: Any) -> Any:
            if grammar_output is not None:
                raise ValueError("the OpWeave executor does not support structured output")
            if self._pending is None:
                return ModelRunnerOutput(req_ids=[], req_id_to_index={})
            order, sampled, logits = self._pending
            self._pending = None
            tokens: dict[str, list[int]] = {rid: [] for rid in order}
            for row, rid in enumerate(sampled):
                req = self.engine.requests[rid]
                p = req.params
                if p is not None and p.seed is not None and req.generator is None:
                    req.generator = torch.Generator().manual_seed(p.seed)
                assert logits is not None
                token = sample(
                    logits[row].cpu(),
                    temperature=0.0 if p is None else float(p.temperature),
                    top_k=0 if p is None or p.top_k is None or p.top_k < 0 else int(p.top_k),
                    top_p=1.0 if p is None else float(p.top_p),
                    min_p=0.0 if p is None else float(p.min_p),
                    generator=req.generator,
                )
                self.engine.append_token(rid, token)
                tokens[rid] = [token]
            return ModelRunnerOutput(
                req_ids=order,
                req_id_to_index={rid: i for i, rid in enumerate(order)},
                sampled_token_ids=[tokens[rid] for rid in order],
            )

        def _check_params(self, p: Any) -> None:
            if p is None:
                return
            unsupported = []
            if p.logprobs is not None or p.prompt_logprobs is not None:
                unsupported.append("logprobs")
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                unsupported.append("penalties")
            for what in unsupported:
                if what not in self._warned:
                    self._warned.add(what)
                    _log.warning("the OpWeave executor ignores %s (not implemented)", what)

        # -- everything else vLLM may ask for --------------------------------------------------
        def collective_rpc(
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple = (),
            kwargs: dict | None = None,
            non_block: bool = False,
        ) -> Any:
            kwargs = kwargs or {}
            if callable(method):
                result = method(self, *args, **kwargs)
            else:
                local = {
                    "get_supported_tasks": lambda: ("generate",),
                    "update_max_model_len": lambda n: setattr(
                        self.model_config, "max_model_len", n
                    ),
                    "synchronize_device": lambda: None,
                    "reset_mm_cache": lambda: None,
                    "reset_encoder_cache": lambda: None,
                    "shutdown": lambda: None,
                    "take_draft_token_ids": lambda: None,
                    "supports_draft_weight_updates": lambda: False,
                    "list_loras": lambda: set(),
                }
                if method not in local:
                    raise NotImplementedError(f"the OpWeave executor has no {method!r}")
                result = local[method](*args, **kwargs)
            results = [result]
            if non_block:
                future: Future[Any] = Future()
                future.set_result(results)
                return future
            return results

        def take_draft_token_ids(self) -> None:
            return None

        def check_health(self) -> None:
            """Raises :class:`~opweave.runtime.RunFailedError` once a stage worker has died."""
            self.pipeline.check()

        @property
        def worker_pids(self) -> list[int]:
            """Process ids of the stage workers (empty in-process)."""
            return list(getattr(self.pipeline, "pids", ()))

        def shutdown(self) -> None:
            pipeline = getattr(self, "pipeline", None)
            if pipeline is not None:
                with contextlib.suppress(OpWeaveRuntimeError):
                    pipeline.close()

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return False

    OpWeaveExecutor.__module__ = "opweave.runtime.vllm"
    OpWeaveExecutor.__qualname__ = "OpWeaveExecutor"
    return OpWeaveExecutor
