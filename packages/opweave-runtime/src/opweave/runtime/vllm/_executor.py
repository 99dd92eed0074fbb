# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported only where vLLM is installed)
"""The OpWeave executor for vLLM's v1 engine.

Imported (with vLLM) when ``opweave.runtime.vllm.OpWeaveExecutor`` is first asked for; the
class is known by that name, so that a dotted name, and pickling the config into vLLM's
engine-core process, both find it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput

from opweave.costmodel import OpWeaveError, canonical_plan, load_model

from .._private.cluster import Cluster
from .._private.graph import check_runtime_support
from .._private.nodes import Topology
from .._private.placement import plan_model
from .._private.stepping import Step, StepDriver, StepItem
from .._private.work import SamplingParams
from ..errors import OpWeaveRuntimeError
from ._config import (
    APPLIED,
    NODES_KEY,
    PLAN_KEY,
    REQUEST_CHECK,
    leave_failure,
    load_plan,
    quiet_explained_failures,
    refuse,
    run_options,
    unapplied,
)

_log = logging.getLogger("opweave.runtime.vllm")


class _Deferred(Future):
    """A future computed by the first thread that asks for its result: the engine core's,
    when it wants a step's tokens (no thread of ours waits for the ranks). Only ``result()``
    computes it: vLLM's engine core asks nothing else of an executor's futures."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        super().__init__()
        self._compute: Callable[[], Any] | None = compute

    def result(self, timeout: float | None = None) -> Any:
        compute, self._compute = self._compute, None
        if compute is not None:
            try:
                self.set_result(compute())
            except BaseException as exc:  # raised again just below, to the caller
                self.set_exception(exc)
        return super().result(timeout)


def _done(future: Future, value: Any) -> Future:
    future.set_result(value)
    return future


def _unwrap(value: Any) -> Any:
    return value.result() if isinstance(value, Future) else value


def _follow_the_front_end() -> None:
    """In vLLM's engine-core process (started by the server with multiprocessing): die with the
    server process, however it ends. vLLM's engine would otherwise outlive a SIGKILLed server
    (or one the OOM killer chose) under PID 1 with every rank; with it gone, the rank launcher
    and the ranks follow (each has a parent-death signal) and the run's reaper removes its
    folder (:mod:`~opweave.runtime._private.reaper`)."""
    import multiprocessing

    from .._private.proc import die_with_parent

    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)


class OpWeaveExecutor(Executor):
    """Runs each engine step on a plan's ranks (:class:`~opweave.runtime.Cluster`).

    The plan comes through vLLM's own configuration: ``additional_config={"opweave_plan":
    PATH_OR_DICT}`` (``--additional-config`` on vLLM's command line); without one the model
    runs colocated on one rank. vLLM keeps the requests (tokenizer, scheduler, sampling
    parameters, detokenisation, the server); each step's scheduler output becomes one
    iteration of the plan (:class:`~opweave.runtime._private.stepping.StepDriver`): every
    request keeps a slot of the plan's global batch, its microbatch pipelines through the
    stages, and the last stage samples with the request's parameters. The scheduler is
    capped at the plan's global batch (``max_num_seqs``) and the KV capacity reported to it
    covers that many requests of ``max_model_len`` tokens, so vLLM never admits more
    requests than the plan's attention owners hold.

    It supports vLLM's asynchronous scheduling (vLLM's default where the executor does): a
    step is submitted to the ranks at once and its tokens collected when the engine asks for
    them, so the engine schedules the next step meanwhile. Over static decode steps
    (``opweave_decode_step``) a decode step's tokens then stay on the ranks and the next
    step runs them without waiting for the engine (:class:`StepDriver`); otherwise a step
    that needs tokens still in flight waits for them first.

    A rank that dies or hangs fails the step with an error naming it, makes
    :meth:`check_health` raise and tells vLLM's engine through its failure callback;
    :meth:`shutdown` stops and reaps every rank.
    """

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        _follow_the_front_end()
        quiet_explained_failures()  # the failures this executor leaves a line for
        extra = self.vllm_config.additional_config
        extra = extra if isinstance(extra, dict) else {}
        if self.speculative_config is not None:
            refuse("the OpWeave executor does not support speculative decoding")
        if self.lora_config is not None:
            refuse("the OpWeave executor does not support LoRA")
        self._check_requests_are_checked()
        # State lives in the ranks' operators per request: a prefix-cache hit would hand us a
        # request whose first tokens no rank holds, so switch it off.
        self.cache_config.enable_prefix_caching = False
        self._failure_callbacks: list[Any] = []
        model_dir = self.model_config.model
        model = load_model(model_dir)
        check_runtime_support(model)
        plan = load_plan(extra.get(PLAN_KEY))
        if plan is None:
            batch = int(self.scheduler_config.max_num_seqs)
            plan = canonical_plan(model, "colocated", gpu="cpu", batch=batch)
        model = plan_model(plan, model_dir)  # the plan's KV-cache dtype
        nodes = dict(extra.get(NODES_KEY) or {})
        options = run_options(extra, dtype=str(self.model_config.dtype))
        topology = Topology(
            nnodes=int(nodes.get("nnodes", 1)),
            nodes=nodes.get("layout"),
            master_addr=str(nodes.get("master_addr", "127.0.0.1")),
            master_port=nodes.get("master_port"),
        )
        try:
            cluster = Cluster(
                plan,
                model,
                model_dir,
                options,
                topology=topology,
                start_method="launcher",  # this process runs vLLM's threads: never fork it
            )
        except OpWeaveError as exc:  # ranks that did not start or warm up: say why in one line
            leave_failure(str(exc))
            raise
        self.cluster = cluster
        self.cluster.on_failure.append(self._notify_failure)
        gb = self.cluster.global_batch
        if self.scheduler_config.max_num_seqs > gb:
            self.scheduler_config.max_num_seqs = gb
        self.driver = StepDriver(self.cluster)
        # tokens stay on the ranks only when the engine schedules ahead (not on CPU, whose
        # platform turns asynchronous scheduling off): otherwise every token is named
        self.driver.carry = self.cluster.static_decode and bool(
            self.scheduler_config.async_scheduling
        )
        self.plan = plan
        # submitted steps whose tokens the engine has not asked for yet, oldest first
        self._steps: deque[tuple[list[str], Step]] = deque()
        _log.info(
            "OpWeave executor: %s plan, %d rank(s), global batch %d, %d microbatch(es)",
            plan.strategy,
            self.cluster.world,
            gb,
            plan.microbatches,
        )

    def _check_requests_are_checked(self) -> None:
        """Every request must pass :data:`REQUEST_CHECK` in vLLM's front end (this process
        cannot refuse one: an error in a step stops the engine), and no default that the
        model's generation config sets may ask for what the ranks do not apply."""
        given = [
            p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}"
            for p in self.model_config.logits_processors or ()
        ]
        others = [p for p in given if p != REQUEST_CHECK]
        if others:
            refuse(
                f"the OpWeave executor runs no custom logits processors "
                f"({', '.join(others)}): its ranks sample with {APPLIED}; remove them"
            )
        if REQUEST_CHECK not in given:
            refuse(
                f"start vLLM with logits_processors=[{REQUEST_CHECK!r}] (--logits-processors "
                f"{REQUEST_CHECK}; opweave serve does): it refuses requests for what the "
                "OpWeave executor does not compute (logprobs, penalties, structured output)"
            )
        defaults = self.model_config.get_diff_sampling_param()
        found = unapplied(SimpleNamespace(**defaults))
        if found:
            refuse(
                f"the model's generation config sets {', '.join(found)}, which OpWeave's "
                f"ranks do not apply (they sample with {APPLIED}); serve with "
                "--generation-config vllm, or override them with --override-generation-config"
            )

    def _notify_failure(self) -> None:
        if self.cluster.failed is not None:
            leave_failure(str(self.cluster.failed))
        for callback in self._failure_callbacks:
            with contextlib.suppress(Exception):
                callback()

    def _block_size(self) -> int:
        return int(self.cache_config.block_size or 16)

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        arch = load_model(self.model_config.model).arch
        one = FullAttentionSpec(
            block_size=self._block_size(),
            num_kv_heads=arch.num_kv_heads,
            head_size=arch.head_dim,
            dtype=self.model_config.dtype,
        )
        return [{f"model.layers.{i}.self_attn.attn": one for i in range(arch.num_layers)}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBHNC"]]

    def set_kv_cache_layout(self, layout_name: str) -> None:
        pass  # the ranks keep their own per-request state

    def determine_available_memory(self) -> list[int]:
        """Bytes for ``global batch`` requests of ``max_model_len`` tokens in every layer
        (vLLM sizes its block table from this)."""
        spec = self.get_kv_cache_specs()[0]
        one = next(iter(spec.values()))
        per_req_blocks = math.ceil(self.model_config.max_model_len / self._block_size())
        requests = self.cluster.global_batch
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
        self.cluster.check()
        if not non_block:
            return _unwrap(fn(arg))
        future: Future[Any] = Future()
        try:
            out = fn(arg)
        except Exception as exc:  # surfaced by future.result() in the engine core
            future.set_exception(exc)
            return future
        return out if isinstance(out, Future) else _done(future, out)

    def _execute(self, so: Any) -> None:
        drv = self.driver
        for rid in so.finished_req_ids:
            drv.drop(rid)
        for rid in so.preempted_req_ids or ():
            if rid in drv.requests:
                drv.restart(rid)
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise ValueError("the OpWeave executor needs prompt token ids (no embeds)")
            drv.add(new.req_id, new.prompt_token_ids, self._params(new.sampling_params))
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        all_ids = getattr(cached, "all_token_ids", None) or {}
        for i, rid in enumerate(cached.req_ids):
            starts[rid] = cached.num_computed_tokens[i]
            if rid in resumed or rid in all_ids:  # a resumed request: vLLM re-sends tokens
                drv.restart(rid, all_ids.get(rid))
        order = list(so.num_scheduled_tokens)
        items = [StepItem(rid, starts[rid], so.num_scheduled_tokens[rid]) for rid in order]
        if not items:  # nothing to run: an idle engine still frees what finished
            drv.flush()
            return ModelRunnerOutput(req_ids=[], req_id_to_index={})
        # submitted now; its tokens are collected when the engine asks for them, so under
        # vLLM's asynchronous scheduling the next step is scheduled meanwhile
        self._steps.append((order, drv.submit(items)))
        return None

    def _sample(self, grammar_output: Any) -> Any:
        if grammar_output is not None:
            raise ValueError("the OpWeave executor does not support structured output")
        if not self._steps:  # its execute_model failed: None makes the engine raise that
            return None
        order, step = self._steps.popleft()

        def output() -> Any:
            sampled = self.driver.collect(step)
            return ModelRunnerOutput(
                req_ids=order,
                req_id_to_index={rid: i for i, rid in enumerate(order)},
                sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in order],
            )

        return _Deferred(output)

    def _params(self, p: Any) -> SamplingParams:
        """The ranks' parameters of a request that passed :data:`REQUEST_CHECK`."""
        if p is None:
            return SamplingParams()
        return SamplingParams(
            temperature=float(p.temperature),
            top_k=0 if p.top_k is None or p.top_k < 0 else int(p.top_k),
            top_p=float(p.top_p),
            min_p=float(p.min_p),
            seed=p.seed,
        )

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
                "update_max_model_len": lambda n: setattr(self.model_config, "max_model_len", n),
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
        """Raises :class:`~opweave.runtime.RunFailedError` once a rank has failed."""
        self.cluster.check()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of this node's ranks."""
        return self.cluster.pids

    def shutdown(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is None:
            return
        with contextlib.suppress(OpWeaveRuntimeError):
            if cluster.failed is None:
                driver = getattr(self, "driver", None)
                if driver is not None:
                    driver.flush()  # frees, and tokens a last step forwarded, taken
                cluster.shutdown()
        cluster.close()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True


OpWeaveExecutor.__module__ = "opweave.runtime.vllm"
