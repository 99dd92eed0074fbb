"""What a run reports: :class:`RunResult`, with :class:`RankStats` per rank (frozen, typed).

Times are seconds; a timeline holds cumulative values at the end of every iteration (one entry
per iteration for a rank, per driven microbatch for the driver), so a steady-state window of one
run can be read from it. ``opweave run --json`` prints a :class:`RunResult`; its JSON Schema is
``schemas/run-result.schema.json``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

RUN_RESULT_SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Output(_Frozen):
    """One request's generation."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str | None = Field(description='"stop" (a stop token) or "length".')
    token_times_s: tuple[float, ...] = Field(
        description="When each token reached the driver, since the first iteration began."
    )
    text: str | None = Field(default=None, description="token_ids decoded (the CLI fills it).")
    ttft_s: float | None = Field(
        default=None,
        description="Time to first token: from the run's start (every offline request arrives "
        "then) to its first token.",
    )
    tpot_s: float | None = Field(
        default=None, description="(last - first token time) / (tokens - 1); None for one token."
    )
    transfer_bytes: int | None = Field(
        default=None,
        description="With a prefill pool: the bytes of its state (KV cache, recurrent state) the "
        "prefill ranks sent to the decode ranks.",
    )


class RankTimeline(_Frozen):
    end_s: tuple[float, ...] = Field(description="Time since the rank's first work.")
    busy_s: tuple[float, ...] = Field(description="Time in operators.")
    comm_s: tuple[float, ...] = Field(description="Time blocked in transfers or on the driver.")
    runq_s: tuple[float, ...] = Field(
        default=(), description="Time ready to run but waiting for a CPU (Linux; else 0)."
    )


class RankStats(_Frozen):
    """One rank: where it ran, what it held, where its time went."""

    rank: int
    owner: int
    replica: int
    tp_rank: int
    tp_size: int
    device: str
    host: str
    stages: tuple[str, ...] = Field(description="Its owner's segments, first..last operator.")
    weight_bytes_read: int = Field(description="Bytes read from the checkpoint (its shard).")
    weight_bytes: int = Field(description="Resident weight bytes.")
    load_s: float
    kernels: tuple[str, ...] = Field(description="Operators switched to vLLM's kernels.")
    busy_s: float = Field(description="Time in operators (TP collectives excluded).")
    comm_s: float = Field(description="Blocked in transfers, TP collectives or on the driver.")
    loop_s: float = Field(description="From its first work to its last iteration's end.")
    overhead_s: float = Field(description="The rest of the loop: host work between actions.")
    runqueue_s: float = Field(
        default=0.0,
        description="Of the loop, the time the rank was ready to run but waited for a CPU that "
        "another process held (Linux; else 0): counted in busy_s, comm_s or overhead_s, "
        "whichever it fell in, and not the rank's own work.",
    )
    wait: str = Field(description='"spin" or "block": how it waited for its peers.')
    iterations: int
    computes_per_iteration: int = Field(description="(segment, microbatch) actions each.")
    decode_step: str = Field(
        description='How decode steps ran: "per-request", "static", "compiled" or "traced".'
    )
    submissions: int = Field(
        default=0,
        description="Launches from Python over the run: one per operator run, one per action "
        "whose decode step ran as a compiled static step, one per decode iteration run as a "
        "compiled rank program.",
    )
    decode_iterations: int = Field(
        default=0,
        description="Iterations in which every microbatch the rank ran was a decode step (one "
        "new token per request) and it launched something: the tokens the next two figures "
        "are per.",
    )
    submissions_per_token: float = Field(
        description="Launches from Python per decode iteration: one per operator, one per "
        "segment whose step is compiled, or 1 where a compiled rank program runs the whole "
        "iteration (CPU). Prefills are in submissions, not here."
    )
    host_s_per_token: float = Field(
        description="Host time per decode iteration outside operators and transfers (the "
        "decode iterations' share of overhead_s)."
    )
    warm_up_s: float = Field(
        default=0.0,
        description="Time the warm-up took to build (compile) the decode steps before traffic.",
    )
    traffic_compiles: int = Field(
        default=0,
        description="Graphs torch.compile built after the warm-up, while serving: 0 unless a "
        "decode step met inputs (dtype, shape) the warm-up did not compile it for.",
    )
    timeline: RankTimeline
    requests_held_at_end: int
    state_bytes_at_end: int
    bytes_sent: int
    messages_sent: int
    pool: str = Field(
        default="decode",
        description='"decode", or "prefill" for a rank of the plan\'s prefill pool (owner -1), '
        "which prefills prompts and sends their state to the decode ranks.",
    )


class DriverTimeline(_Frozen):
    end_s: tuple[float, ...]
    drive_s: tuple[float, ...]


class DriverStats(_Frozen):
    """The offline driver's own bookkeeping between a microbatch's tokens and its next work."""

    drive_s: float
    microbatches_per_iteration: int
    start_method: str = Field(
        description="How this node's ranks were started: fork (from a single-threaded driver), "
        "launcher (forked from a clean interpreter) or spawn."
    )
    timeline: DriverTimeline
    works_ahead: int = Field(
        default=0,
        description="Works submitted before their microbatch's previous iteration returned its "
        "tokens: carried works, whose tokens the ranks kept (static decode steps only).",
    )


class PoolTransfer(_Frozen):
    """What a plan's prefill pool handed to its decode pool."""

    prefills: int = Field(description="Prompts the prefill pool computed.")
    bytes: int = Field(
        description="State bytes sent prefill -> decode: per request and state-holding decode "
        "rank, its layers' KV cache (keys and values of the prompt) or recurrent state."
    )
    messages: int = Field(description="One per request and receiving decode rank.")


class RunResult(_Frozen):
    """An offline run: the outputs, the measured TPOT, and per rank its statistics."""

    schema_version: int = RUN_RESULT_SCHEMA_VERSION
    outputs: tuple[Output, ...]
    tpot_s: float | None = Field(
        description="Mean over requests of (last - first token time) / (tokens - 1)."
    )
    ttft_s: float | None = Field(default=None, description="Mean of the requests' ttft_s.")
    transfer: PoolTransfer | None = Field(
        default=None, description="With a prefill pool: what it sent to the decode ranks."
    )
    iterations: int
    wall_s: float
    max_active: int = Field(description="Most requests held at once.")
    driver: DriverStats
    ranks: tuple[RankStats, ...]
