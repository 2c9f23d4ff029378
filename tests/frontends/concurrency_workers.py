"""Front-ends side by side in one training loop, each on a model of its own, their
collectives in flight at once: DDP hooks on their communication threads, Streaming
DiLoCo's delayed all-reduces on its thread, the sharded optimizer's reduce-scatters
overlapping backward. Every policy has two levels (2 ranks per node, 4 ranks), so each
front-end's node sub-groups hold the same ranks as the others'."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from tests.frontends import workers

RANKS_PER_NODE = 2


class _FrontEnd:
    """One model and how it trains: ``loss(x, y)``, ``step()``, ``digest()``."""

    def __init__(self, kind, seed, rank):
        topology = commpress.Topology(RANKS_PER_NODE)
        self.kind = kind
        self.model = workers._model(seed=100 * seed + rank)
        if kind == "sharded":
            self.opt = commpress.ShardedOptimizer(self.model, torch.optim.AdamW, "sdp4bit",
                                                  topology=topology, lr=3e-3,
                                                  bucket_numel=30_000)
            self.forward = self.model
        elif kind == "ddp":
            self.forward = DDP(self.model, bucket_cap_mb=0.1)
            self.state, hook = commpress.ddp_hook(self.forward, "hybrid", topology=topology,
                                                  bucket_numel=25_000)
            self.forward.register_comm_hook(self.state, hook)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        elif kind == "diloco":
            self.forward = self.model
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
            self.sync = commpress.DiLoCo(self.model, self.opt, sync_every=2, fragments=2,
                                         delay=0, policy="diloco-int4", topology=topology)
        elif kind == "streaming":  # delayed: the all-reduces run on DiLoCo's thread
            self.forward = self.model
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
            self.sync = commpress.DiLoCo(self.model, self.opt, sync_every=4, fragments=2,
                                         delay=1, policy="diloco-int4", topology=topology)
        else:
            raise AssertionError(kind)

    def step(self):
        self.opt.step()
        self.opt.zero_grad()

    def digest(self):
        """What must be the same on every rank: the weights of a data-parallel replica,
        θ_global of an outer synchronizer."""
        if self.kind in ("diloco", "streaming"):
            return workers._hash_params(torch.nn.ParameterList(
                torch.nn.Parameter(g) for g in self.sync.global_weights()))
        return workers._hash_params(self.model)

    def close(self):
        if self.kind in ("diloco", "streaming"):
            self.sync.remove()
        elif self.kind == "ddp":
            self.state.remove()


def side_by_side(rank, world, entries, steps):
    """Train one model per ``(kind, seed)`` of ``entries`` in one loop (one backward
    through all of them, then each one's step); the digests after every step, per
    front-end."""
    data = workers._data()
    front_ends = [_FrontEnd(kind, seed, rank) for kind, seed in entries]
    digests = [[] for _ in entries]
    for step in range(steps):
        x, y = workers._local_batch(data, step, rank, world)
        sum(f.forward(x, y)[1] for f in front_ends).backward()
        for i, f in enumerate(front_ends):
            f.step()
            digests[i].append(f.digest())
    for f in front_ends:
        f.close()
    return digests
