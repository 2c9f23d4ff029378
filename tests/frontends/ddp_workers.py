"""Per-rank DDP runs for the comm hook tests (module level: picklable).

DDP runs collectives of its own on its process group — the unused-parameter map at
the end of backward with ``find_unused_parameters=True``, buffer broadcasts in forward,
bucket rebuilds — while the hook's run on the communication thread. These runs make
DDP do all of them: ranks that leave out a block in forward, ``no_sync``
accumulation, a static graph.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.collectives.group_context import context
from tests.frontends import workers


class SkippingGPT(nn.Module):
    """gpt-tiny whose forward leaves out the blocks in ``skip`` (chosen per rank)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt
        self.skip: set[int] = set()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.gpt.embed(idx)
        for i, block in enumerate(self.gpt.blocks):
            if i not in self.skip:
                x = block(x)
        logits = self.gpt.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def skipped_blocks(schedule: str, step: int, rank: int) -> set[int]:
    """Which blocks rank ``rank`` leaves out at ``step``.

    ``"varying"``: rank 1 skips block 0, then rank 0 skips block 1, then every rank
    skips block 1 (a parameter nobody used), in turn. ``"fixed"``: rank 1 always skips
    block 1 (what a static graph allows). ``"none"``: every block runs.
    """
    if schedule == "varying":
        return [{0} if rank == 1 else set(), {1} if rank == 0 else set(), {1}][step % 3]
    if schedule == "fixed":
        return {1} if rank == 1 else set()
    return set()


def ddp_run(rank, world, policy, steps, options=None):
    """Train ``steps`` steps under DDP (``policy`` None: DDP's own all-reduce); returns
    the parameter hash after every step and the losses.

    ``options``: ``overlap``, ``find_unused``, ``static_graph``, ``micro`` (micro-batches,
    all but the last under ``no_sync``), ``schedule`` (:func:`skipped_blocks`),
    ``dp_groups`` (DDP over the data-parallel group holding this rank; each group draws
    its own batches).
    """
    o = {"overlap": True, "find_unused": False, "static_graph": False, "micro": 1,
         "schedule": "none", "dp_groups": None, **(options or {})}
    group, dp_rank, dp_world, seed = None, rank, world, 0
    if o["dp_groups"] is not None:
        for index, ranks in enumerate(o["dp_groups"]):
            made = dist.new_group(ranks)
            if rank in ranks:
                group, dp_rank, dp_world, seed = made, ranks.index(rank), len(ranks), index
    data = workers._data()
    model = SkippingGPT(workers._model())
    ddp = DDP(model, bucket_cap_mb=0.1, process_group=group,
              find_unused_parameters=o["find_unused"], static_graph=o["static_graph"])
    state = None
    if policy is not None:
        state, hook = commpress.ddp_hook(ddp, policy, overlap=o["overlap"],
                                         bucket_numel=25_000)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    micro = o["micro"]
    hashes, losses, headers = [], [], []
    for step in range(steps):
        ctx = None if state is None else context(state.hook_group)
        sent = None if ctx is None else ctx._seq - ctx.replayed
        x, y = workers._local_batch(data, step, dp_rank, dp_world, seed)
        model.skip = skipped_blocks(o["schedule"], step, dp_rank)
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if i < micro - 1:
                with ddp.no_sync():
                    (ddp(xm, ym) / micro).backward()
            else:
                loss = ddp(xm, ym)
                (loss / micro).backward()
        opt.step()
        opt.zero_grad()
        if ctx is not None:  # the calls of this step that carried a header
            headers.append(ctx._seq - ctx.replayed - sent)
        losses.append(workers._global_loss(loss, world))
        hashes.append(workers._hash_params(model))
    return {"hashes": hashes, "losses": losses, "headers": headers,
            "buckets": None if state is None else len(state.buckets)}


def hook_error(rank, world, fault):
    """Steps of the hook where the ranks go wrong; returns the error each rank saw.

    ``"policies"``: rank 1 compresses with another codec (a mismatch). ``"late"``: rank 1
    reaches backward after the group's timeout. ``"unused"``: rank 1 leaves out a block
    under a DDP that does not look for unused parameters.
    """
    data = workers._data()
    model = SkippingGPT(workers._model())
    ddp = DDP(model, bucket_cap_mb=0.1)
    policy = ({"name": "other", "dp": {"grad": "int8"}} if fault == "policies" and rank == 1
              else "none")
    ddp.register_comm_hook(*commpress.ddp_hook(ddp, policy, bucket_numel=25_000))
    try:
        for step in range(2):
            x, y = workers._local_batch(data, step, rank, world)
            model.skip = {0} if fault == "unused" and rank == 1 else set()
            loss = ddp(x, y)
            if fault == "late" and rank == 1:
                time.sleep(12)  # past the 4 s group timeout (and the 5 s diagnosis grace)
                return {"error": None}
            loss.backward()
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def ignored_parameter_runs(rank, world, hooks, steps=3):
    """DDP told to ignore one parameter (as engines do for frozen towers), trained with
    each of ``hooks`` (None: DDP's own all-reduce; ``"lowrank"``: the low-rank hook; else
    a ``ddp_hook`` policy); per hook the hashes after each step of every parameter and of
    all but the ignored one."""
    from commpress.frontends.ddp_lowrank import lowrank_hook

    data = workers._data()
    out = {}
    for hook in hooks:
        model = SkippingGPT(workers._model())
        ignored = next(n for n, _ in model.named_parameters() if ".blocks.0." in n)
        DDP._set_params_and_buffers_to_ignore_for_model(model, [ignored])
        ddp = DDP(model, bucket_cap_mb=0.1)
        if hook == "lowrank":
            ddp.register_comm_hook(*lowrank_hook(ddp, rank=2, start_iter=1,
                                                 bucket_numel=25_000))
        elif hook is not None:
            ddp.register_comm_hook(*commpress.ddp_hook(ddp, hook, bucket_numel=25_000))
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        every, reduced = [], []
        for step in range(steps):
            x, y = workers._local_batch(data, step, rank, world)
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad()
            every.append(workers._hash_params(model))
            kept = nn.ParameterList(p for n, p in model.named_parameters() if n != ignored)
            reduced.append(workers._hash_params(kept))
        out[str(hook)] = {"every": every, "reduced": reduced}
    return out


def uncompressed_warnings(rank, world):
    """The warnings each rank logs for ``int2ef`` hooks on one node of two ranks (twice),
    then on two nodes of one rank."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress.dp.grad_path").addHandler(handler)
    seen = []
    for topology in (None, None, commpress.Topology(1)):
        ddp = DDP(workers._model(), bucket_cap_mb=0.1)
        state, _ = commpress.ddp_hook(ddp, "int2ef", topology=topology, bucket_numel=25_000)
        seen.append(len(records))
        state.remove()
    return {"messages": records, "after_each": seen}


def elastic(rank, world, directory, phase):
    """``phase="save"``: 2 steps of each front-end with stateful codecs, then every rank's
    state to ``directory``. ``"load"`` (on another number of ranks): each front-end from
    the state of rank ``rank % saved``; what the strict load said, what the elastic one
    logged, and the weights after 2 more steps."""
    import logging
    import os

    from commpress.frontends.ddp_lowrank import lowrank_hook

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress.dp.saved_state").addHandler(handler)
    data = workers._data()
    out = {}
    # "int2ef fresh": the int2ef hook from the saved weights with no codec state at all,
    # what the elastic load's fresh memory must equal
    fronts = ("int2ef", "lowrank", "diloco") + (("int2ef fresh",) if phase == "load" else ())
    for front in fronts:
        kind = front.split()[0]
        model = workers._model()
        opt = None
        if front == "diloco":
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            state = commpress.DiLoCo(model, opt, sync_every=2, policy="diloco-int2ef",
                                     topology=commpress.Topology(1))
            ddp = model
        else:
            ddp = DDP(model, bucket_cap_mb=0.1)
            state, hook = (commpress.ddp_hook(ddp, "int2ef", topology=commpress.Topology(1),
                                              bucket_numel=25_000) if kind == "int2ef" else
                           lowrank_hook(ddp, rank=2, start_iter=1, bucket_numel=25_000,
                                        topology=commpress.Topology(1)))
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        path = os.path.join(directory, f"{kind}-rank{{}}.pt")
        start = 0
        if phase == "load":
            saved_world = len([f for f in os.listdir(directory)
                               if f.startswith(f"{kind}-rank")])
            saved = torch.load(path.format(rank % saved_world), weights_only=True)
            model.load_state_dict(torch.load(os.path.join(directory, f"{kind}-model.pt"),
                                             weights_only=True))
            start = 2
        if phase == "load" and front != "int2ef fresh":
            try:
                state.load_state_dict(saved)
                out[f"{front} strict"] = None
            except ValueError as e:
                out[f"{front} strict"] = str(e)
            if front == "lowrank":  # another low-rank config: refused even elastically
                try:
                    state.load_state_dict({**saved, "lowrank": {**saved["lowrank"], "rank": 3}},
                                          elastic=True)
                except ValueError as e:
                    out["lowrank other config"] = str(e)
            state.load_state_dict(saved, elastic=True)
        hashes = []
        for step in range(start, start + 2):
            x, y = workers._local_batch(data, step, rank, world)
            logits = ddp(x)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            hashes.append(workers._hash_params(model))
        out[front] = hashes
        if phase == "save":
            torch.save(state.state_dict(), path.format(rank))
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(directory, f"{front}-model.pt"))
        state.remove()  # one verb for every front-end
    out["logged"] = records
    return out


def backward_after_remove(rank, world, lowrank):
    """One step with the hook, remove(), one more backward: what that backward raises
    (torch cannot unregister the hook; a silent re-made group would train on)."""
    data = workers._data()
    ddp = DDP(SkippingGPT(workers._model()), bucket_cap_mb=0.1)
    if lowrank:
        state, hook = commpress.lowrank_hook(ddp, rank=2, bucket_numel=25_000)
    else:
        state, hook = commpress.ddp_hook(ddp, "int8", bucket_numel=25_000)
    ddp.register_comm_hook(state, hook)
    x, y = workers._local_batch(data, 0, rank, world, 0)
    ddp(x, y).backward()
    state.remove()
    saved = state.state_dict()  # still readable after remove()
    try:
        ddp(x, y).backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "saved": sorted(saved)}
