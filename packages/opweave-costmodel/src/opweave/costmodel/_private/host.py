"""Host profiles: the per-step time a serving engine's host work adds to a decode step.

Between two decode steps an engine schedules, prepares the next step's inputs, reads the sampled
tokens back and turns them into outputs. An engine that overlaps that work with the GPU's step
leaves the GPU a short gap; one that does not makes every step wait for it. That time belongs to
the engine (its version and scheduling mode) and the host CPU, not to the GPU, so it is not a
hardware-catalog figure: a :class:`HostProfile` names an engine's value and where it was
measured, and :func:`estimate_step` (``host=``) or ``opweave estimate --host NAME`` applies it in
place of the hardware's ``step_overhead_s`` / ``step_overhead_per_request_s`` (charged to the
``sample`` operator, ``fixed_costs.step_overhead_s``).

Sources:
  [VLLM-GAP] vllm-project/vllm#11133: with asynchronous scheduling and CUDA graphs the GPU sits
  idle 150-170 us between two decode steps (5-6 ms before).
  [SGL-HOST] sgl-project/sglang-omni#760, H100, CUDA graphs, no overlap: the host's share of a
  decode step is 1.36-1.38 / 1.65-1.66 / 1.82-1.86 ms at batch 16 / 24 / 32.
  [QWEN-0.5B] QwenLM/Qwen2.5 docs/source/benchmark/speed_benchmark.rst (vLLM 0.6.3, A100 80GB,
  CUDA graphs, batch 1, ``LLM.generate`` with repetition/presence/frequency penalties):
  Qwen2.5-0.5B-Instruct generates at 311.55 tokens/s, 3.210 ms a step, of which the roofline
  with its fixed costs (A100, context 1025) accounts for 1.496 ms of GPU work: 1.71 ms is host.
  A model this small (0.99 GB of weights) is where a step is mostly host time; the same table's
  7B-72B rows, which the accuracy benchmark compares, are not used for it.
  [VLLM-6913] vllm-project/vllm#6913 (vLLM 0.5, 4 x H100, Llama-3-70B FP8): the engine's output
  processing (``_process_model_outputs``, on the critical path before the asynchronous output
  processor of vLLM 0.6.0) takes 0.2 ms at batch 1 and 3.4 ms at batch 32: 0.103 ms a request.
  [EAGER-PREFILL] SGLang captures CUDA graphs of decode batches only: a step with prompt
  chunks runs eagerly, its kernels enqueued one by one from Python (piecewise prefill graphs
  are opt-in, ``--enable-piecewise-cuda-graph``, sgl-project/sglang#10062 "SGLang's current
  native prefilling can incur kernel launch overhead"). TensorRT-LLM's PyTorch flow likewise
  graphs generation-only batches; its docs (``torch_compile_and_piecewise_cuda_graph.md``) call
  the context phase's iterations host-bound. The host enqueues ahead of the GPU, so such a step
  takes the longer of the two: wejoncy/sfllm#46 measures Qwen3-4B's eager prefill at 16.6 ms for
  129 tokens and 16.4 ms for 513, where the same forwards in a graph take 5.7 and 13.7 ms. The
  host's time per launch is taken from sgl-project/sglang#12160: an eager DeepSeek-V3 prefill
  forward of one new token (GPU time 23.1 ms in a graph) takes 82.6 ms, 68 us for each of the
  1,209 kernels OpWeave's DeepSeek-V3 forward launches (``OperatorSpec.kernels``). Check:
  sgl-project/sglang#13094 (Llama-3.1-8B FP8, TP 8, 1,024-token prompts, one client) measures a
  mean TTFT of 30.0 ms eager and 19.7 ms with piecewise graphs; 68 us x its 324 launches is
  22 ms of host time, which leaves 8 ms for the front end, consistent with the 10.3 ms the
  piecewise graphs save (they leave attention eager). The value belongs to the host CPU and
  the engine's Python path as much as to the model. vLLM V1 runs steps of up to 512 tokens in
  piecewise CUDA graphs and larger ones through torch.compile's generated code; no measurement
  of the latter's per-launch host time was found, so the vLLM profiles charge none.
"""

from __future__ import annotations

from pydantic import Field

from ..errors import ConfigError
from .base import Frozen
from .hardware import HardwareSpec

US = 1e-6
MS = 1e-3


class HostProfile(Frozen):
    """The host time one engine adds to every decode step: ``step_overhead_s`` plus
    ``step_overhead_per_request_s`` per request of the step."""

    name: str
    step_overhead_s: float = Field(ge=0, description="Per decode step (and microbatch).")
    step_overhead_per_request_s: float = Field(
        default=0.0, ge=0, description="... and per request of the step."
    )
    eager_launch_s: float = Field(
        default=0.0,
        ge=0,
        description="Host time per kernel launch of a step with prompt chunks, which the engine "
        "runs outside CUDA graphs (0: it graphs or compiles them).",
    )
    description: str = ""
    source: str = Field(default="", description="Where the values were measured.")

    def apply(self, hardware: HardwareSpec) -> HardwareSpec:
        """``hardware`` with this engine's per-step host time in place of its own.

        >>> from opweave.costmodel import default_catalog
        >>> hw = HOST_PROFILES["vllm-0.4"].apply(default_catalog().get("a100"))
        >>> round(hw.step_overhead_s * 1e3, 2), round(hw.step_overhead_per_request_s * 1e6)
        (1.71, 103)
        """
        return hardware.model_copy(
            update={
                "step_overhead_s": self.step_overhead_s,
                "step_overhead_per_request_s": self.step_overhead_per_request_s,
                "eager_launch_s": self.eager_launch_s,
            }
        )


# vLLM 0.6's V0 engine at batch 1 [QWEN-0.5B]; shared by the 0.4 profile, which adds the output
# processing that 0.6 overlaps with the GPU [VLLM-6913].
VLLM_V0_STEP_S = 1.71 * MS
VLLM_V0_OUTPUT_PER_REQUEST_S = (3.4 - 0.2) / (32 - 1) * MS
# [EAGER-PREFILL]: 82.6 ms over the 1,209 kernels of DeepSeek-V3's forward
DEEPSEEK_V3_KERNELS = 1209
EAGER_LAUNCH_S = 82.6 * MS / DEEPSEEK_V3_KERNELS
# [VLLM-GAP]: the gap an overlapped scheduler leaves between decode steps
OVERLAPPED_STEP_S = 160 * US

HOST_PROFILES: dict[str, HostProfile] = {
    profile.name: profile
    for profile in (
        HostProfile(
            name="overlapped",
            step_overhead_s=OVERLAPPED_STEP_S,
            description="An engine that overlaps its host work with the GPU's step "
            "(asynchronous scheduling: vLLM V1 with async scheduling, SGLang's and TensorRT-LLM's "
            "overlap schedulers, OpWeave's compiled schedules, a CUDA-graph replay loop without a "
            "host sync) and graphs or compiles its steps with prompt chunks (vLLM V1). The "
            "catalog's default.",
            source="[VLLM-GAP] vllm-project/vllm#11133",
        ),
        HostProfile(
            name="sglang",
            step_overhead_s=OVERLAPPED_STEP_S,
            eager_launch_s=EAGER_LAUNCH_S,
            description="SGLang with its overlap scheduler (the default): decode steps as "
            "'overlapped', steps with prompt chunks eager (no prefill CUDA graphs), at least "
            "their kernels' launch time.",
            source="[VLLM-GAP] for the decode gap; [EAGER-PREFILL] sgl-project/sglang#12160 for "
            "68 us per launch of an eager step",
        ),
        HostProfile(
            name="sglang-sync",
            step_overhead_s=0.90 * MS,
            step_overhead_per_request_s=29 * US,
            eager_launch_s=EAGER_LAUNCH_S,
            description="SGLang's scheduler without overlap: schedule, launch, sync, process; "
            "steps with prompt chunks eager as in 'sglang'.",
            source="[SGL-HOST] sgl-project/sglang-omni#760 (H100): 0.90 ms + 29 us per request; "
            "[EAGER-PREFILL] for the eager steps",
        ),
        HostProfile(
            name="tensorrt-llm",
            step_overhead_s=OVERLAPPED_STEP_S,
            eager_launch_s=EAGER_LAUNCH_S,
            description="TensorRT-LLM's PyTorch flow with its overlap scheduler: "
            "generation-only steps in CUDA graphs, steps with context chunks eager, charged "
            "SGLang's measured launch time (both enqueue PyTorch kernels from Python).",
            source="[VLLM-GAP] for the decode gap; [EAGER-PREFILL] for the eager steps",
        ),
        HostProfile(
            name="vllm-0.6",
            step_overhead_s=VLLM_V0_STEP_S,
            description="vLLM 0.6's V0 engine, single-step scheduling, CUDA graphs: schedule, "
            "prepare inputs, sample and read the tokens back before the next step; output "
            "processing overlapped (asynchronous output processor).",
            source="[QWEN-0.5B] QwenLM/Qwen2.5 speed_benchmark.rst, Qwen2.5-0.5B, vLLM 0.6.3, "
            "A100: 3.21 ms a step less 1.50 ms of modelled GPU work",
        ),
        HostProfile(
            name="vllm-0.4",
            step_overhead_s=VLLM_V0_STEP_S,
            step_overhead_per_request_s=VLLM_V0_OUTPUT_PER_REQUEST_S,
            description="vLLM 0.4-0.5's V0 engine: as vllm-0.6, plus output processing "
            "(detokenisation, stop checks) on the critical path of every step.",
            source="[QWEN-0.5B] for the step; [VLLM-6913] vllm-project/vllm#6913 for the "
            "0.103 ms per request of output processing",
        ),
    )
}


def engine_host(engine: str) -> HostProfile | None:
    """The host profile a serving engine runs with by default: ``None`` for vLLM V1 (the
    hardware's own per-step cost, an overlapped engine that graphs its steps), the profile of
    the engine's name for SGLang and TensorRT-LLM.

    >>> engine_host("vllm") is None, engine_host("sglang").eager_launch_s > 0
    (True, True)
    """
    return None if engine == "vllm" else host_profile(engine)


def host_profile(name: str) -> HostProfile:
    """A built-in host profile by name.

    >>> round(host_profile("vllm-0.6").step_overhead_s * 1e3, 2)
    1.71
    """
    try:
        return HOST_PROFILES[name.strip().lower()]
    except KeyError:
        raise ConfigError(
            f"unknown host profile {name!r}; known: {', '.join(HOST_PROFILES)}"
        ) from None
