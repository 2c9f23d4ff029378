"""Per-rank functions for the ShardedOptimizer setup tests (module level: picklable)."""

import hashlib

import torch
import torch.nn as nn

import commpress


def _net_with_frozen_weight_and_batchnorm(seed: int) -> nn.Module:
    """A frozen first layer, a BatchNorm whose running statistics have seen one batch
    drawn from ``seed``, and a trainable head."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    net[0].weight.requires_grad_(False)
    net(torch.randn(32, 8))  # train mode: the running statistics move
    return net


def _state_hashes(net: nn.Module) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                                 .tobytes())
            .hexdigest() for name, t in net.state_dict().items()}


def init_sync_with_frozen_and_buffers(rank, world, init_sync, differ):
    """Ranks build the net from the same seed (``differ`` None) or from their own, or
    change only ``differ`` ("frozen", "buffer") on ranks other than 0."""
    net = _net_with_frozen_weight_and_batchnorm(rank if differ == "seed" else 0)
    with torch.no_grad():
        if differ == "frozen" and rank > 0:
            net[0].weight.add_(1.0)
        if differ == "buffer" and rank > 0:
            net[1].running_var.add_(1.0)
    try:
        commpress.ShardedOptimizer(net, torch.optim.SGD, "none", lr=0.1, init_sync=init_sync)
    except commpress.CollectiveMismatchError as e:
        return {"error": str(e)}
    return {"error": None, "hashes": _state_hashes(net)}
