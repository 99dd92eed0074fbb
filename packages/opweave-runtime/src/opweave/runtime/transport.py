"""The runtime's transport seam, for tools that measure what serving runs (the profiler).

:class:`Transport` is a rank's message endpoint (the native wire between CPU ranks, NCCL
point-to-point between GPUs); :class:`Message` names one message of a schedule; :func:`pin_to_core`
binds a CPU rank to its core (how long it then busy-polls while it waits is
:meth:`~opweave.runtime.RunOptions.spin_s`).
"""

from ._private.proc import pin_to_core
from ._private.schedule import Message
from ._private.transport import Transport
from ._private.wire import PeerError

__all__ = ["Message", "PeerError", "Transport", "pin_to_core"]
