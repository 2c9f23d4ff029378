"""Per-rank functions for the torchtitan tests (module level: picklable): torchtitan's
llama3 debug model (2 layers, SDPA attention: FlexAttention has no CPU backward),
sharded by torchtitan's own ``apply_fsdp_to_decoder`` on an HSDP mesh, 2 nodes x 2."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

import commpress
from tests.engines.hsdp_workers import NODES, local_shards_hash
from tests.frontends.workers import _data, _global_loss, _local_batch

LAYERS = 2


def _llama3(world, policy, divide_by_tokens=False):
    """``divide_by_tokens``: keep torchtitan's gradient divide factor 1.0 (it scales the
    loss itself), a PREMUL_SUM Gloo cannot run stock; else FSDP's own averaging."""
    config = model_registry("debugmodel", attn_backend="flex").model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    mesh = init_device_mesh("cpu", (NODES, world // NODES),
                            mesh_dim_names=("dp_replicate", "fsdp"))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                          reduce_dtype=torch.float32, pp_enabled=False)
    if not divide_by_tokens:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(None)
    comm = commpress.torchtitan.compress(model, policy) if policy is not None else None
    return model, comm


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def titan_runs(rank, world, policies, steps, lr=3e-3):
    """``steps`` AdamW steps of the llama3 debug model per policy (``None``: stock)."""
    data = _data()
    out = []
    for policy in policies:
        model, comm = _llama3(world, policy)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        commpress.reset_stats()
        losses = []
        for step in range(steps):
            x, y = _local_batch(data, step, rank, world)
            loss = _loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global_loss(loss, world))
        out.append({"losses": losses, "local": local_shards_hash(model),
                    "stats": commpress.stats(),
                    "comm": (type(comm).__name__, len(comm)) if comm is not None else None})
    return out


def titan_gradients(rank, world, runs):
    """One backward per ``(policy, divide_by_tokens)`` in ``runs`` (policy ``None``:
    stock) on the same batch: the full gradients of each, as numpy (tensors would travel
    back as shared memory of an exited process)."""
    x, y = _local_batch(_data(), 0, rank, world)
    grads = []
    for policy, divide_by_tokens in runs:
        model, _ = _llama3(world, policy, divide_by_tokens)
        _loss(model, x, y).backward()
        grads.append([p.grad.full_tensor().numpy() for p in model.parameters()])
    return grads


def titan_killed_mid_step(rank, world, victim):
    """zeropp on the HSDP mesh; the victim SIGKILLs itself after the forward pass of
    step 2."""
    from tests.reliability.killing import Killer

    data = _data()
    model, _ = _llama3(world, "zeropp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    killer = Killer(rank, victim, at_step=2)

    def loop():
        for step in range(1000):
            x, y = _local_batch(data, step, rank, world)
            loss = _loss(model, x, y)
            killer.mid_step(step)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return killer.survive(loop)


def _error(fn):
    """The error ``fn()`` raises, as ``"Type: message"``, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads which error it was
        return f"{type(e).__name__}: {e}"
    return None


def _train(model, steps):
    data = _data()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = _local_batch(data, step, rank, world)
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return local_shards_hash(model)


def titan_adversarial(rank, world):
    """What a user can get wrong around ``commpress.torchtitan.compress``, on the llama3
    HSDP mesh: each case's error (or None) and the shard hashes of a stock run and of a
    run compressed, compressed again, then removed before its first step."""
    out = {"stock": _train(_llama3(world, None)[0], 2)}
    model, _ = _llama3(world, None)
    # ranks on different policies: told on every rank before any collective of its own
    out["policies"] = _error(lambda: commpress.torchtitan.compress(
        model, "zeropp" if rank == 0 else "sdp4bit"))
    out["parts"] = [_error(lambda: commpress.torchtitan.compress([])),
                    _error(lambda: commpress.torchtitan.compress([model, "layers"]))]
    comm = commpress.torchtitan.compress([model], "int2ef")
    out["twice"] = _error(lambda: commpress.torchtitan.compress(model, "int2ef"))
    state = comm.state_dict()
    # another rank's file (each rank saves its own entry)
    other = {k: v for k, v in state.items() if not k.startswith("rank")}
    other[f"rank{(rank + 1) % world}"] = state[f"rank{rank}"]
    out["other_rank"] = _error(lambda: comm.load_state_dict(other))
    truncated = dict(state)
    truncated[f"rank{rank}"] = state[f"rank{rank}"][: len(state[f"rank{rank}"]) // 2]
    out["truncated"] = _error(lambda: comm.load_state_dict(truncated))
    out["smaller_world"] = _error(lambda: comm.load_state_dict({**state, "world_size": 2}))
    out["own"] = _error(lambda: comm.load_state_dict(state))
    comm.remove()
    comm.remove()
    out["removed"] = _train(model, 2)
    # one rank's NaN loss, stock and compressed: the elements stock leaves non-finite
    # (the embedding rows rank 3 did not use stay finite) that zeropp made finite
    x, y = _local_batch(_data(), 0, rank, world)
    nonfinite = []
    for policy in (None, "zeropp"):
        model, _ = _llama3(world, policy)
        loss = _loss(model, x, y)
        (loss * float("nan") if rank == world - 1 else loss).backward()
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
        nonfinite.append([~p.to_local().isfinite() for p in model.parameters()])
    out["nan_stock"] = sum(int(m.sum()) for m in nonfinite[0])
    out["nan_made_finite"] = sum(int((s & ~c).sum()) for s, c in zip(*nonfinite))
    return out
