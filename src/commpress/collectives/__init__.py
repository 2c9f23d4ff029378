"""Compressed collectives over any torch.distributed process group.

Rules for asynchronous calls (``async_op=True``) and CUDA streams:

1. **Inputs** (``reduce_scatter``'s and ``all_gather``'s ``input``, a send's tensor) may
   be reused or freed as soon as the call returns: compressed paths encode them during
   the call, and the exact paths hand torch a copy.
2. **Outputs and in-place tensors** (``all_reduce``'s ``tensor``, the ``output``
   arguments, a receive's tensor) hold the result only after ``handle.wait()``; do not
   read or write them before.
3. **Streams**: encoding runs on the caller's current stream when the call is made;
   ``wait()`` waits for the transfer (for NCCL: makes the current stream wait for the
   communication stream) and then decodes on the current stream. Every buffer handed
   to the backend stays referenced by the handle until the transfer completes. To
   read a result on another stream, record an event after ``wait()`` on this one.
4. One group, one thread at a time: collectives on a group must be issued in the same
   order on every rank (as with torch.distributed); each call is checked across ranks
   (:mod:`commpress.collectives.agreement`).
"""

from commpress.collectives.compressed_all_gather import all_gather
from commpress.collectives.compressed_all_reduce import all_reduce
from commpress.collectives.compressed_all_to_all import all_to_all
from commpress.collectives.compressed_reduce_scatter import reduce_scatter
from commpress.collectives.delta_gather import delta_all_gather
from commpress.collectives.group_context import GroupContext, context
from commpress.collectives.handle import Handle
from commpress.collectives.hierarchical import (
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    reduce_scatter_parts,
)
from commpress.collectives.mismatch import CollectiveMismatchError, CollectiveTimeoutError
from commpress.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from commpress.collectives.topology import Topology
from commpress.collectives.totals import reset_stats, stats
from commpress.collectives.watch import Watch

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupContext",
    "Handle",
    "P2POp",
    "Topology",
    "Watch",
    "all_gather",
    "all_to_all",
    "all_reduce",
    "batch_isend_irecv",
    "context",
    "delta_all_gather",
    "hierarchical_all_gather",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter",
    "reduce_scatter_parts",
    "reset_stats",
    "send",
    "stats",
]
