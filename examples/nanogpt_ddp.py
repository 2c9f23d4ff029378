"""A nanoGPT-style training loop with commpress: DDP plus one comm hook.

    torchrun --standalone --nproc_per_node 2 examples/nanogpt_ddp.py --steps 40

What a loop like nanoGPT's ``train.py`` does, with the commpress lines marked:
gradient accumulation through ``require_backward_grad_sync``, ``clip_grad_norm_``,
a checkpoint that rank 0 alone writes, and — since each rank's error-feedback memory
is its own — each rank's codec state in a file beside it (``commpress.save_rank_state``).
``--resume`` continues from that checkpoint bit for bit.

``int2ef`` is exact inside a node and 1.75-bit across nodes: on one node it sends the
same bytes as stock DDP (rank 0 says so). To see the codes on one machine, pretend each
rank is a node (``--ranks-per-node 1``) or give one codec for every bucket
(``--policy int4:hadamard=128``). ``--torch-powersgd R`` registers torch's own PowerSGD
hook of rank R instead, for comparison.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--policy", default="int2ef", help="preset, policy file or codec spec")
parser.add_argument("--ranks-per-node", type=int, default=None,
                    help="the topology (default: torchrun's LOCAL_WORLD_SIZE)")
parser.add_argument("--torch-powersgd", type=int, default=None, metavar="RANK",
                    help="torch's PowerSGD hook of this rank instead of commpress's")
parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's bucket size")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
parser.add_argument("--batch", type=int, default=8, help="sequences per rank and micro-batch")
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", default="out-nanogpt")
parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this step")
parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
parser.add_argument("--report", default=None, help="write losses and weight hashes (JSON)")
args = parser.parse_args()

# -- distributed set-up, as nanoGPT does it ------------------------------------------
dist.init_process_group("gloo")  # "nccl" on GPUs
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # every rank starts from the same weights (DDP broadcasts them too)
data = TextData(load_tokens(max_bytes=1 << 20))  # real text: the Python standard library
model = GPT(config_from_preset("gpt-tiny", block_size=args.seq_len))
model = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
raw_model = model.module

# -- commpress: one hook on the DDP model --------------------------------------------
hook_state = None
if args.torch_powersgd is not None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    hook_state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.torch_powersgd,
        start_powerSGD_iter=2, random_seed=0)
    model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
else:
    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hook_state, hook = commpress.ddp_hook(model, args.policy,
                                          topology=commpress.Topology(per_node))
    model.register_comm_hook(hook_state, hook)

optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
checkpoint = os.path.join(args.out, "ckpt.pt")
codec_file = os.path.join(args.out, f"commpress-rank{rank}.pt")  # commpress: one per rank
start = 0
if args.resume:
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    raw_model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start = saved["iter_num"]
    hook_state.load_state_dict(commpress.load_rank_state(codec_file))  # commpress


def save(iter_num: int) -> None:
    if rank == 0:  # nanoGPT: the master process writes the checkpoint
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num}, checkpoint)
    commpress.save_rank_state(hook_state.state_dict(), codec_file)  # commpress: every rank


def weights_hash() -> str:
    h = hashlib.sha256()
    for p in raw_model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the loop ------------------------------------------------------------------------
losses = []
for step in range(start, args.steps):
    x, y = data.batch("train", args.batch * world * args.accumulate, args.seq_len, 0, step)
    micro = x.chunk(world * args.accumulate)
    targets = y.chunk(world * args.accumulate)
    for m in range(args.accumulate):
        model.require_backward_grad_sync = m == args.accumulate - 1  # sync on the last only
        i = rank * args.accumulate + m
        _, loss = model(micro[i], targets[i])
        (loss / args.accumulate).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    losses.append(mean_loss.item() / world)
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if args.save_at is not None and step + 1 == args.save_at:
        save(step + 1)

hashes = [None] * world
dist.all_gather_object(hashes, weights_hash())
counters = commpress.stats().values()  # per label: calls, raw_bytes, wire_bytes, ...
wire, raw = (sum(c[k] for c in counters) for k in ("wire_bytes", "raw_bytes"))
if rank == 0:
    print(f"replicas identical: {len(set(hashes)) == 1}; loss {losses[-1]:.4f}; "
          f"rank 0 sent {wire / 1e6:.2f} MB for {raw / 1e6:.2f} MB of gradients")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"losses": losses, "hashes": hashes, "stats": commpress.stats()}, f)
dist.destroy_process_group()
