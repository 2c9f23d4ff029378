"""Ranks measuring their compressed collectives with a :class:`commpress.Watch` (module
level: picklable)."""


import commpress


def watched_all_reduce(rank, world, x):
    """Each rank all-reduces its own part of ``x`` with int4 asynchronously inside a watch:
    what the watch read before ``wait()``, and after it."""
    mine = x[rank].clone()
    watch = commpress.Watch()
    with watch.watching():
        handle = commpress.all_reduce(mine, "int4", label="watched", async_op=True)
        before = watch.read()
    handle.wait()
    return {"before": before, "after": watch.read(), "input": x[rank]}
