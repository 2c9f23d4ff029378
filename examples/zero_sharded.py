"""A loop written for torch's ZeroRedundancyOptimizer, on commpress's ShardedOptimizer.

    torchrun --standalone --nproc_per_node 2 examples/zero_sharded.py --steps 40

The change is the optimizer line (and no DDP wrapper: the optimizer reduces the
gradients itself, as 4-bit codes with ``sdp4bit``)::

    # before
    model = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3)
    # after
    opt = commpress.ShardedOptimizer(model.parameters(), torch.optim.AdamW, "sdp4bit", lr=3e-3)

Schedulers, ``torch.nn.utils.clip_grad_norm_`` and ``state_dict`` work as they did.
``--optimizer zero`` runs torch's version of the same loop, for comparison. A
checkpoint is ``consolidate_state_dict(to=0)`` saved by rank 0; ``--resume`` loads it
with ``elastic=True``, on the same or another number of ranks.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--optimizer", choices=("commpress", "zero"), default="commpress")
parser.add_argument("--policy", default="sdp4bit", help="ShardedOptimizer's policy")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", default="out-zero")
parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this step")
parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
parser.add_argument("--report", default=None, help="write losses and weight hashes (JSON)")
args = parser.parse_args()

dist.init_process_group("gloo")  # "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
data = TextData(load_tokens(max_bytes=1 << 20))  # real text: the Python standard library
raw_model = GPT(config_from_preset("gpt-tiny", block_size=args.seq_len))
if args.optimizer == "zero":
    model = DDP(raw_model)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr,
                                  weight_decay=0.1)
else:
    model = raw_model
    opt = commpress.ShardedOptimizer(model.parameters(), torch.optim.AdamW, args.policy,
                                     lr=args.lr, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
checkpoint = os.path.join(args.out, "ckpt.pt")
start = 0
if args.resume:
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    raw_model.load_state_dict(saved["model"])
    if args.optimizer == "zero":
        opt.load_state_dict(saved["optimizer"])
    else:  # any number of ranks; the codecs start fresh
        opt.load_state_dict(saved["optimizer"], elastic=True)
    sched.load_state_dict(saved["scheduler"])
    start = saved["iter_num"]


def save(iter_num: int) -> None:
    if args.optimizer == "zero":
        opt.consolidate_state_dict(to=0)
        state = opt.state_dict() if rank == 0 else None
    else:
        state = opt.consolidate_state_dict(to=0)  # every rank calls it; rank 0 gets it
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": raw_model.state_dict(), "optimizer": state,
                    "scheduler": sched.state_dict(), "iter_num": iter_num}, checkpoint)
    dist.barrier()


def weights_hash() -> str:
    h = hashlib.sha256()
    for p in raw_model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


losses = []
for step in range(start, args.steps):
    x, y = data.batch("train", args.batch * world, args.seq_len, 0, step)
    _, loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm either way
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    losses.append(mean_loss.item() / world)
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if args.save_at is not None and step + 1 == args.save_at:
        save(step + 1)

hashes = [None] * world
dist.all_gather_object(hashes, weights_hash())
if rank == 0:
    print(f"replicas identical: {len(set(hashes)) == 1}; loss {losses[-1]:.4f}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"losses": losses, "hashes": hashes}, f)
dist.destroy_process_group()
