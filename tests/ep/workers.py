"""Ranks of the expert-parallel tests (module level: picklable)."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

import commpress
from commpress.ep import EPExchange

WIDTH = 96  # not a multiple of the codecs' groups: every token is padded on its own


def _moe_step(rank, world, exchange):
    """Tokens routed to random expert ranks, each rank's expert a linear layer, and back:
    → (loss, grad of the tokens, grad of this rank's expert)."""
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randn(24, WIDTH, generator=g, requires_grad=True)
    dest = torch.randint(0, world, (24,), generator=g)
    order = torch.argsort(dest, stable=True)
    in_splits = torch.bincount(dest, minlength=world).tolist()
    counts = torch.tensor(in_splits)
    table = torch.empty(world * world, dtype=torch.int64)
    dist.all_gather_into_tensor(table, counts)
    out_splits = table.view(world, world)[:, rank].tolist()
    expert = torch.nn.Linear(WIDTH, WIDTH, bias=False)
    with torch.no_grad():
        expert.weight.copy_(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(
            100 + rank)) / WIDTH ** 0.5)
    routed = exchange("dispatch", tokens[order], in_splits, out_splits)
    back = exchange("combine", torch.relu(expert(routed)), out_splits, in_splits)
    out = torch.empty_like(back)
    out[order] = back
    loss = (out * torch.linspace(-1, 1, WIDTH)).square().mean()
    loss.backward()
    return loss.detach(), tokens.grad, expert.weight.grad


def dispatch_and_combine(rank, world, policy):
    """A mixture-of-experts step through EPExchange against torch's differentiable
    all_to_all_single: ``none`` is bit for bit; a compressed policy stays close and counts
    bytes on the four directions it compresses."""
    def stock(kind, x, in_splits, out_splits):
        return dist_fn.all_to_all_single(x.new_empty(sum(out_splits), x.shape[1]), x,
                                         out_splits, in_splits)

    ep = EPExchange(policy, dist.group.WORLD)
    commpress.reset_stats()

    def ours(kind, x, in_splits, out_splits):
        return getattr(ep, kind)(x, in_splits, out_splits)

    exact = _moe_step(rank, world, stock)
    got = _moe_step(rank, world, ours)
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(got, exact)]
    stats = commpress.stats()
    ratio = {k: v["wire_bytes"] / v["raw_bytes"] for k, v in stats.items()
             if k.startswith("ep.") and v["raw_bytes"]}
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(got, exact)), "rel": rel,
            "ratio": ratio, "state": ep.state_dict()["policy"]}


def killed_mid_dispatch(rank, world, victim):
    """Steps of dispatch and combine; the victim dies between its dispatch and its combine,
    so the survivors wait for it inside the exchange."""
    from tests.reliability.killing import Killer

    ep = EPExchange("ep-int8", dist.group.WORLD)
    killer = Killer(rank, victim, at_step=2)

    def loop():
        for step in range(5):
            x = torch.randn(4 * world, WIDTH, requires_grad=True)
            splits = [4] * world
            routed = ep.dispatch(x, splits, splits)
            killer.mid_step(step)
            ep.combine(routed * 2, splits, splits).sum().backward()

    return killer.survive(loop)
