"""Rank functions for collectives in flight from several threads, each on a group of its
own over the same ranks: each thread must get what it gets alone, bit for bit."""

import threading

import torch
import torch.distributed as dist

import commpress

# (collective, intra codec, inter codec): two levels, the levels' sub-groups in play
CALLS = [("hierarchical_all_reduce", "none", "int4"),
         ("hierarchical_reduce_scatter", "int8", "int4:hadamard=32"),
         ("all_reduce", None, "int8")]


def _input(thread, call, rank, numel):
    g = torch.Generator().manual_seed(10_000 * thread + 100 * call + rank)
    return torch.randn(numel, generator=g)


def _one_call(kind, intra, inter, x, group, topology, world, label):
    if kind == "hierarchical_all_reduce":
        y = x.clone()
        commpress.hierarchical_all_reduce(y, intra=intra, inter=inter, topology=topology,
                                          group=group, op="sum", label=label)
        return y
    if kind == "hierarchical_reduce_scatter":
        out = torch.empty(x.numel() // world)
        commpress.hierarchical_reduce_scatter(out, x, intra=intra, inter=inter,
                                              topology=topology, group=group, op="sum",
                                              label=label)
        return out
    y = x.clone()
    commpress.all_reduce(y, inter, group=group, op="sum", label=label)
    return y


def _thread_calls(thread, rank, world, group, topology, calls, numel):
    out = []
    for c in range(calls):
        kind, intra, inter = CALLS[(thread + c) % len(CALLS)]
        x = _input(thread, c, rank, numel)
        out.append(_one_call(kind, intra, inter, x, group, topology, world, f"thread{thread}"))
    return out


def threads_on_groups_of_the_same_ranks(rank, world, threads, calls, ranks_per_node, numel):
    """Each thread runs ``calls`` collectives on its own group, first all at once, then
    one thread at a time on fresh groups; returns whether every result matched."""
    topology = commpress.Topology(ranks_per_node)
    every = list(range(world))
    concurrent = [dist.new_group(every) for _ in range(threads)]
    results: dict[int, list] = {}
    errors: list[str] = []

    def run(t):
        try:
            results[t] = _thread_calls(t, rank, world, concurrent[t], topology, calls, numel)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        return {"errors": errors}
    alone = [_thread_calls(t, rank, world, dist.new_group(every), topology, calls, numel)
             for t in range(threads)]
    same = all(torch.equal(a, b) for t in range(threads)
               for a, b in zip(results[t], alone[t]))
    return {"errors": [], "same": same}
