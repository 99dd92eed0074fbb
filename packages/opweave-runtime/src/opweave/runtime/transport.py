"""The runtime's transport seam, for tools that measure what serving runs (the profiler).

:class:`Transport` is a rank's message endpoint (the socket wire between CPU ranks, NCCL or gloo
point-to-point elsewhere); :class:`Message` names one message of a schedule; :func:`spin_budget`
and :func:`pin_to_core` decide how a CPU rank waits and where it runs.
"""

from ._private.rank import pin_to_core
from ._private.schedule import Message
from ._private.transport import Transport
from ._private.wire import PeerError, spin_budget

__all__ = ["Message", "PeerError", "Transport", "pin_to_core", "spin_budget"]
