"""Compressed collectives over any torch.distributed process group."""

from commpress.collectives.all_gather import all_gather
from commpress.collectives.all_reduce import all_reduce
from commpress.collectives.context import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GroupContext,
    context,
)
from commpress.collectives.delta_gather import delta_all_gather
from commpress.collectives.handle import Handle
from commpress.collectives.hierarchical import (
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)
from commpress.collectives.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from commpress.collectives.reduce_scatter import reduce_scatter
from commpress.collectives.stats import reset_stats, stats
from commpress.collectives.topology import Topology

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GroupContext",
    "Handle",
    "P2POp",
    "Topology",
    "all_gather",
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
    "reset_stats",
    "send",
    "stats",
]
