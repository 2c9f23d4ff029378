"""Rank functions for collectives on empty (0-element) tensors (module level: picklable)."""

import torch

import commpress
from commpress.collectives.topology import Topology

DTYPES = (torch.float32, torch.bfloat16)


def _calls(spec, dtype, rank, topology):
    """Every public collective on 0 elements with codec ``spec``, by name; each returns
    its result's shape."""
    def empty():
        return torch.empty(0, dtype=dtype)

    def two_ways(send, recv):
        # one tag per direction: with two ranks, each sends the other at once
        peer = rank ^ 1
        ops = [commpress.P2POp("send", send, peer, spec, tag=rank),
               commpress.P2POp("recv", recv, peer, spec, tag=peer)]
        for h in commpress.batch_isend_irecv(ops):
            h.wait()
        return recv

    def with_error_feedback(out):
        ef = commpress.ErrorFeedback()
        commpress.reduce_scatter(empty(), empty(), spec, memory=ef)
        return commpress.all_gather(out, empty(), spec, memory=ef)

    return {
        "all_reduce": lambda: commpress.all_reduce(empty(), spec),
        "reduce_scatter": lambda: commpress.reduce_scatter(empty(), empty(), spec),
        "all_gather": lambda: commpress.all_gather(empty(), empty(), spec),
        "all_gather_async": lambda: commpress.all_gather(empty(), empty(), spec,
                                                         async_op=True).wait(),
        "hierarchical_reduce_scatter": lambda: commpress.hierarchical_reduce_scatter(
            empty(), empty(), intra=spec, inter=spec, topology=topology),
        "hierarchical_all_gather": lambda: commpress.hierarchical_all_gather(
            empty(), empty(), intra=spec, inter=spec, topology=topology),
        "hierarchical_all_reduce": lambda: commpress.hierarchical_all_reduce(
            empty(), intra=spec, inter=spec, topology=topology),
        "delta_all_gather": lambda: commpress.delta_all_gather(
            empty(), torch.empty(0), codec=spec, topology=topology),
        "send_recv": lambda: two_ways(empty(), empty()),
        "error_feedback": lambda: with_error_feedback(empty()),
    }


def empty_collectives(rank, world, specs, dtypes, ranks_per_node, only=None):
    """Every collective (or those named in ``only``) on 0 elements with every codec in
    ``specs`` and dtype in ``dtypes``; returns ``"spec/dtype/collective"`` → the
    result's shape, or the error."""
    results = {}
    topology = Topology(ranks_per_node)
    for spec in specs:
        for dtype in dtypes:
            for name, call in _calls(spec, dtype, rank, topology).items():
                if only is not None and name not in only:
                    continue
                key = f"{spec}/{str(dtype).removeprefix('torch.')}/{name}"
                try:
                    results[key] = tuple(call().shape)
                except Exception as e:  # noqa: BLE001 - each call's error is the result
                    results[key] = f"{type(e).__name__}: {e}"
    return results
