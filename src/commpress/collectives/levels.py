"""Which codec levels a collective runs on: the one case analysis of a node layout."""

from __future__ import annotations

from commpress.validate import InputError


def levels_used(two_level: bool, world: int, ranks_per_node: int) -> tuple[str, ...]:
    """The codec levels a collective runs on ``world`` ranks in nodes of
    ``ranks_per_node``: ``("single",)`` for a one-level codec, ``("intra", "inter")``,
    or the one level left when there is one node (``intra``) or one rank per node
    (``inter``). The one place this is decided: the two-level collectives, the played
    ones and the cost model all ask here."""
    if world < 1 or ranks_per_node < 1 or world % ranks_per_node:
        raise InputError(f"ranks={world}, ranks_per_node={ranks_per_node} is not allowed; "
                         "allowed: positive, ranks a multiple of ranks_per_node")
    if not two_level:
        return ("single",)
    if world == ranks_per_node:
        return ("intra",)
    return ("inter",) if ranks_per_node == 1 else ("intra", "inter")
