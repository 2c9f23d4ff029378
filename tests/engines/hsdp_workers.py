"""Per-rank functions for the FSDP2 HSDP tests: 4 ranks as 2 nodes x 2, a 2-D mesh
(replicate, shard) (module level: picklable)."""

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import commpress
from tests.engines.fsdp_workers import _full_params_hash
from tests.frontends.workers import _data, _local_batch, _model, train_steps

NODES = 2


def hsdp_mesh(world):
    return init_device_mesh("cpu", (NODES, world // NODES),
                            mesh_dim_names=("replicate", "shard"))


def local_shards_hash(model) -> str:
    """The hash of this rank's own shards: equal on the ranks of one shard coordinate
    (the replicas) exactly when the replicas agree bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hsdp_model(world, policy, divide_factor=None):
    model = _model()
    mesh = hsdp_mesh(world)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide_factor is not None:
        for module in model.modules():  # the setter covers one FSDP module's parameters
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(divide_factor)
    compression = commpress.fsdp.compress(model, policy) if policy is not None else None
    return model, compression


def hsdp_training(rank, world, policy, steps, divide_factor=None):
    """Train ``steps`` steps with stock HSDP (``policy=None``) or compressed."""
    data = _data()
    model, compression = hsdp_model(world, policy, divide_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    commpress.reset_stats()
    losses = train_steps(model, opt, data, rank, world, 0, steps)
    return {"losses": losses, "stats": commpress.stats(), "local": local_shards_hash(model),
            "full": _full_params_hash(model), "groups": collective_groups(model, compression),
            "state_keys": (sorted(compression.codec_states()[""])
                           if compression is not None else None)}


def collective_groups(model, compression) -> list[tuple]:
    """The global ranks each FSDP module's weight all-gather, gradient reduce-scatter and
    (compressed) replicate all-reduce run over, as FSDP will call them."""
    ranks = dist.get_process_group_ranks
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            replicate = None
            if compression is not None and compression.modules[name][1].replicate is not None:
                replicate = ranks(compression.modules[name][1].replicate.group)
            out.append((ranks(param_group._all_gather_process_group),
                        ranks(param_group._reduce_scatter_process_group), replicate))
    return out


def hsdp_gradients(rank, world, runs):
    """One backward per ``(policy, divide factor)`` in ``runs``; the full gradients of
    each (every rank computes the same ones)."""
    x, y = _local_batch(_data(), 0, rank, world)
    out = []
    for policy, factor in runs:
        model, _ = hsdp_model(world, policy, factor)
        _, loss = model(x, y)
        loss.backward()
        # numpy arrays: tensors would travel back as shared memory of an exited process
        out.append([p.grad.full_tensor().numpy() for p in model.parameters()])
    return out


def hsdp_refusals(rank, world, cases):
    """The error ``compress`` or the backward raises, by HSDP layout it cannot cover."""
    return {case: _refusal(rank, world, case) for case in cases}


def _refusal(rank, world, case):
    model = _model()
    if case == "shard_size_1":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    else:
        fully_shard(model, mesh=hsdp_mesh(world))
    try:
        commpress.fsdp.compress(model, "zeropp")
        if case == "no_all_reduce":
            model.set_requires_all_reduce(False)
            x, y = _local_batch(_data(), 0, rank, world)
            _, loss = model(x, y)
            loss.backward()
        return None
    except (ValueError, RuntimeError) as e:
        dist.barrier()
        return f"{type(e).__name__}: {e}"


def hsdp_runs(rank, world, policies, steps):
    """:func:`hsdp_training` for each policy in turn, in one process group."""
    return [hsdp_training(rank, world, policy, steps) for policy in policies]


def hsdp_overlap(rank, world, policy):
    """Gradients of two backward passes (the second accumulating into the first's) with
    the replicate all-reduce overlapping backward where FSDP allows it, and with it
    forced to finish in place; how many all-reduces each pass left in flight."""
    from commpress.engines import fsdp

    x, y = _local_batch(_data(), 0, rank, world)
    started = []
    add = fsdp.InFlight.add

    def counted(self, handle):
        started.append(len(self.handles) + 1)  # in flight once this one is added
        add(self, handle)

    out = {}
    for mode in ("overlap", "in place"):
        fsdp.InFlight.add = counted
        real = fsdp._untouched_until_step
        if mode == "in place":
            fsdp._untouched_until_step = lambda *args: False
        try:
            model, _ = hsdp_model(world, policy)
            grads, in_flight = [], []
            for _ in range(2):  # the second pass accumulates into .grad
                started.clear()
                _, loss = model(x, y)
                loss.backward()
                in_flight.append(max(started, default=0))
                grads.append([p.grad.full_tensor().numpy().copy() for p in model.parameters()])
        finally:
            fsdp.InFlight.add, fsdp._untouched_until_step = add, real
        out[mode] = {"grads": grads, "in_flight": in_flight}
    return out


def hsdp_remove(rank, world, policy, steps):
    """Stock HSDP; compressed then removed before training; compressed for half the
    steps, then removed; a second compress refused, one after remove() accepted."""
    data = _data()
    out = {}
    for name in ("stock", "removed at once", "removed midway"):
        model, compression = hsdp_model(world, None if name == "stock" else policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        half = steps // 2 if name == "removed midway" else 0
        losses = train_steps(model, opt, data, rank, world, 0, half)
        if compression is not None:
            compression.remove()
            compression.remove()  # idempotent
        commpress.reset_stats()
        losses += train_steps(model, opt, data, rank, world, half, steps - half)
        out[name] = {"losses": losses, "local": local_shards_hash(model),
                     "stats": sorted(commpress.stats())}
    again = commpress.fsdp.compress(model, policy)  # allowed once removed
    try:
        commpress.fsdp.compress(model, policy)
        out["twice"] = None
    except commpress.InputError as e:
        out["twice"] = str(e)
    commpress.reset_stats()
    out["again"] = train_steps(model, opt, data, rank, world, steps, 1)
    out["again stats"] = sorted(commpress.stats())
    again.remove()
    return out
