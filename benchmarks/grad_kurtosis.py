"""Are the small model's gradients heavy-tailed? Kurtosis per gradient bucket, and what
Hadamard smoothing does to int4 error on them.

    python benchmarks/grad_kurtosis.py [--model gpt-1m] [--steps 300]

Trains one process (same data and optimizer as the trainer) and, at a few steps,
measures each parameter group's gradient: excess kurtosis (0 for a Gaussian, 6 for
Laplace-like, large for heavy tails) and the relative L2 error of int4 (group 128) with
and without a Hadamard-128 rotation. Writes benchmarks/results/grad_kurtosis.md.
"""

from __future__ import annotations

import argparse

import torch
from _common import write_markdown

from commpress.codecs import codec
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens


def kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    c = x - x.mean()
    return float((c**4).mean() / (c**2).mean() ** 2 - 3.0)


def rel(c, x):
    return float((c.decode(c.encode(x)) - x).norm() / x.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TextData(load_tokens(max_bytes=8 << 20))
    model = GPT(config_from_preset(args.model))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    plain, smooth = codec("int4"), codec("int4:hadamard=128")
    probes = sorted({1, 10, args.steps // 2, args.steps})
    rows = []
    for step in range(1, args.steps + 1):
        x, y = data.batch("train", 16, 128, 0, step - 1)
        _, loss = model(x, y)
        loss.backward()
        if step in probes:
            groups = {"embeddings": [], "attention": [], "mlp": [], "norms+biases": []}
            for n, p in model.named_parameters():
                key = ("norms+biases" if p.dim() < 2 else "embeddings" if n.startswith(
                    ("wte", "wpe", "lm_head")) else "attention" if ".attn." in n else "mlp")
                groups[key].append(p.grad.flatten())
            for key, parts in groups.items():
                g = torch.cat(parts)
                rows.append((step, key, g.numel(), kurtosis(g), rel(plain, g), rel(smooth, g)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    lines = [f"{args.model}, batch 16 × 128, AdamW lr 3e-3: gradient statistics by step", "",
             "| step | parameters | elements | excess kurtosis | int4 rel err | "
             "int4+Hadamard128 rel err | ratio |", "|---|---|---|---|---|---|---|"]
    for step, key, n, k, e0, e1 in rows:
        lines.append(f"| {step} | {key} | {n:,} | {k:.1f} | {e0:.4f} | {e1:.4f} | "
                     f"{e1 / e0:.2f} |")
    write_markdown("grad_kurtosis.md", lines)


if __name__ == "__main__":
    main()
