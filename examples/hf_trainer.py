"""A Hugging Face Trainer script with commpress: one line before ``trainer.train()``.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --steps 20

A tiny GPT-2 built from a config (no download) trained on real text by the Trainer's
own DDP; ``commpress.transformers.compress`` registers the hook inside it and keeps each
rank's codec state in the Trainer's checkpoints (``checkpoint-<step>/commpress-rank<r>.pt``),
so ``--resume`` continues from the last one. The default, 4-bit codes after a Hadamard
rotation, compresses on any layout; ``--policy int2ef`` (exact inside a node, 1.7-bit
codes between nodes) is for several machines, or ``--ranks-per-node 1`` to play nodes on
one.
"""

import argparse
import hashlib
import json
import logging

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import commpress
from commpress.train.data import TextData, load_tokens

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--policy", default="int4:hadamard=128",
                    help="preset, policy file or codec spec")
parser.add_argument("--ranks-per-node", type=int, default=None, help="the topology")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--out", default="out-hf")
parser.add_argument("--save-steps", type=int, default=10)
parser.add_argument("--resume", action="store_true", help="from --out's last checkpoint")
parser.add_argument("--report", default=None, help="write losses and weight hashes (JSON)")
args = parser.parse_args()
logging.getLogger("transformers").setLevel(logging.ERROR)


class Samples(torch.utils.data.Dataset):
    """Fixed sequences of the text, the labels the inputs (the model shifts them)."""

    def __init__(self, data: TextData, n: int) -> None:
        self.x, _ = data.batch("train", n, args.seq_len, 0, 0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


data = TextData(load_tokens(max_bytes=1 << 20))  # real text: the Python standard library
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=data.vocab_size, n_positions=args.seq_len,
                                   n_embd=64, n_layer=2, n_head=2))
training = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    max_steps=args.steps, learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0,
    logging_steps=1, save_strategy="steps", save_steps=args.save_steps, report_to=[],
    use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=training, train_dataset=Samples(data, 512))
topology = commpress.Topology(args.ranks_per_node) if args.ranks_per_node else None
commpress.transformers.compress(trainer, args.policy, topology=topology)  # commpress
trainer.train(resume_from_checkpoint=True if args.resume else None)

weights = hashlib.sha256(b"".join(
    p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    for p in trainer.model.parameters())).hexdigest()
hashes = [None] * dist.get_world_size()
dist.all_gather_object(hashes, weights)
losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
if dist.get_rank() == 0:
    print(f"replicas identical: {len(set(hashes)) == 1}; loss {losses[-1]:.4f}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"losses": losses, "hashes": hashes}, f)
