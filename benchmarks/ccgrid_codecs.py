"""ZFP fixed-rate (the CCGrid paper's compressor) against group quantization at equal
bits, on the tensors a training run sends: gradients, activations, weights, weight
differences.

    python benchmarks/ccgrid_codecs.py [--model gpt-1m] [--steps 30]

Trains the model for ``--steps`` steps in one process (AdamW, the default corpus),
then records the flat gradient, the hidden state entering every block (what tensor
parallelism all-reduces), the weights and one step's weight difference, and reports
each codec's relative L2 error and bits per element. Writes
benchmarks/results/ccgrid_codecs.md.
"""

from __future__ import annotations

import argparse

import torch
from _common import write_markdown

from commpress.codecs import codec
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

PAIRS = [("zfp:rate=4", "int4"), ("zfp:rate=4", "int4:hadamard=128"),
         ("zfp:rate=8", "int8"), ("zfp:rate=8", "fp8"), ("zfp:rate=16", "bf16")]


def tensors(model_name: str, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    data = TextData(load_tokens(max_bytes=2 << 20))
    model = GPT(config_from_preset(model_name, vocab_size=max(256, data.vocab_size)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    acts: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda m, a: acts.append(a[0].detach().reshape(-1)))
             for b in model.blocks]
    for step in range(steps + 1):
        acts.clear()
        x, y = data.batch("train", 16, 128, 0, step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if step == steps:
            break
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        opt.step()
    for h in hooks:
        h.remove()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"gradients": torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
            "activations": torch.cat(acts), "weights": weights,
            "weight differences": weights - before}


def rel_err(spec: str, x: torch.Tensor) -> tuple[float, float]:
    c = codec(spec)
    packet = c.encode(x)
    y = c.decode(packet)
    return ((y - x).norm() / x.norm()).item(), 8 * packet.nbytes / x.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    data = tensors(args.model, args.steps)
    lines = [f"{args.model} after {args.steps} AdamW steps; relative L2 error (bits per "
             "element):", "", "| tensor | " + " | ".join(f"{a} vs {b}" for a, b in PAIRS) + " |",
             "|---|" + "---|" * len(PAIRS)]
    for name, x in data.items():
        cells = []
        for a, b in PAIRS:
            (ea, ba), (eb, bb) = rel_err(a, x), rel_err(b, x)
            cells.append(f"{ea:.4f} ({ba:.2f}) / {eb:.4f} ({bb:.2f})")
        lines.append(f"| {name} ({x.numel():,}) | " + " | ".join(cells) + " |")
    write_markdown("ccgrid_codecs.md", lines)


if __name__ == "__main__":
    main()
