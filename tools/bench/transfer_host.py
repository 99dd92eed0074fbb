"""Host time of one hop between two static decode steps: a packed batch vs the step's rows.

Between two ranks running static decode steps (``--decode-step static|compiled|traced``) a
decode iteration's activations can travel two ways, and this measures the host work of each,
side by side in one process (CPU, one thread, median of many calls):

- **packed**: the sender selects the link's requests and packs them with a header
  (:func:`~opweave.runtime._private.batch.pack`); the receiver unpacks, merges its sources and
  hands the batch to the step, which pads it into its rows and gathers the requests' rows of
  the outputs back out (:meth:`StaticStep.__call__`);
- **rows**: the sender hands the wire byte views of its outputs' rows, the receiver copies the
  message into its step's input rows and runs the step on them as they are
  (:meth:`StaticStep.run_rows`); this is what ranks do since the rows path exists.

The step itself has no operators here, so what is timed is the host work around it: the hop's
message's assembly for the native wire (its parts in one buffer, as :meth:`NativeWire.send`
takes them; the C++ framing and writes left out), the schedule of the step
(its positions and state rows, the same on both paths) and the copies. On a GPU the packed path
also reads each message's length on the host before it can receive the rest (a device
synchronisation per hop); the rows path reads nothing.

Run: ``uv run python tools/bench/transfer_host.py``. Prints figures; asserts nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from opweave.runtime._private.batch import BatchMeta, TokenBatch, byte_view, pack, unpack
from opweave.runtime._private.decode import StaticStep
from opweave.runtime._private.transport import merge, select

# (requests of the link, slots of the step, hidden size, tensors at the cut): a tiny model's
# AFD hop, a small model's CAD hop (hidden and residual cross), a 4096-wide model's
CASES = [
    (3, 4, 64, ("hidden",)),
    (4, 4, 512, ("hidden", "residual")),
    (32, 32, 4096, ("hidden", "residual")),
]


def median_us(fn: Callable[[], object], calls: int = 3000) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def assemble(*parts: torch.Tensor) -> torch.Tensor:
    """A message's bytes in one buffer, as the native wire's ``send`` takes several parts."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def hop(requests: int, slots: int, hidden: int, names: tuple[str, ...]) -> tuple[float, float]:
    rids = tuple(f"r{i}" for i in range(requests))
    meta = BatchMeta(rids, (1,) * requests, (100,) * requests, tuple(range(requests)))
    outputs = {n: torch.randn(slots, hidden, dtype=torch.bfloat16) for n in names}
    live = TokenBatch(meta, {n: t[:requests] for n, t in outputs.items()})
    step = StaticStep([], None, slots)  # no operators: the host work around a step
    place = list(range(requests))
    payload = pack(live)
    rows_payload = torch.cat([byte_view(outputs[n]).reshape(-1) for n in sorted(names)])
    inputs = {n: torch.zeros(slots, hidden, dtype=torch.bfloat16) for n in names}

    def packed() -> None:
        assemble(pack(select(live, range(slots))))
        step(merge([unpack(payload)]), place)

    def rows() -> None:
        assemble(*[byte_view(outputs[n]).reshape(-1) for n in sorted(names)])
        offset = 0
        for n in sorted(names):
            raw = byte_view(inputs[n]).reshape(-1)
            raw.copy_(rows_payload[offset : offset + raw.numel()])
            offset += raw.numel()
        step.run_rows(inputs, rids, meta.context_lens, place)

    with torch.inference_mode():
        return median_us(packed), median_us(rows)


def main() -> None:
    torch.set_num_threads(1)
    print("Host time of one hop between static decode steps (sender + receiver), CPU, one thread")
    print(f"{'requests/slots':<15}{'hidden':>7}  {'tensors':<18}{'packed us':>10}{'rows us':>9}")
    for requests, slots, hidden, names in CASES:
        packed, rows = hop(requests, slots, hidden, names)
        print(
            f"{f'{requests}/{slots}':<15}{hidden:>7}  {'+'.join(names):<18}"
            f"{packed:>10.1f}{rows:>9.1f}   {packed / rows:.1f}x"
        )


if __name__ == "__main__":
    main()
