"""Refuse a run that cannot fit in memory before it allocates anything.

``simulate --ranks 100000 --batch-size 100000`` used to start, print nothing and grow
until the machine ran out. A played run holds, besides one replica, every rank's codec
objects and every rank's gradient codes until the step's reduction ends, so its
memory grows with ranks × model; its buckets are padded to a multiple of the ranks.
Before any tensor is made, the parts below are counted from the same layout the run
will use (the optimizer's buckets, built over a ``meta`` model; the codecs' own wire
sizes) and compared with the memory available. Each part is a lower bound — the
activations count only the logits, the codec objects a measured per-object size —
so a refusal is certain to be right; a run just under the bound may still not fit.
"""

from __future__ import annotations

from contextlib import suppress

import torch

from commpress.collectives import Topology
from commpress.collectives.call import is_exact
from commpress.dp import DPBucket, GradPath, grad_levels
from commpress.frontends.ddp import BUCKET_NUMEL, hook_layout
from commpress.frontends.parts.buckets import build_buckets, tensor_parallel_key
from commpress.model.gpt import GPT, config_from_preset
from commpress.policy import Policy
from commpress.train.config import DTYPES, TrainConfig
from commpress.validate import InputError

# one rank's codec objects for one bucket (its DPBucket): 13 KB
# measured on CPython 3.11 with hybrid, sdp4bit, int2ef and none; counted as 8 KB
CODEC_OBJECT_BYTES = 8 << 10
TOKEN_BYTES = 8  # int64 token ids
VOCAB_AT_LEAST = 256  # the byte tokenizer; a .bin corpus may have more


def simulate_needs(cfg: TrainConfig) -> dict[str, int]:
    """Bytes a resolved ``simulate`` of ``cfg`` holds at least, by part."""
    ranks = cfg.dp
    rpn = cfg.dp_ranks_per_node()
    policy = cfg.policy_object()
    numels = _bucket_numels(cfg, policy, ranks, rpn)
    path = GradPath(policy, Topology(rpn))
    # --outer: every site's weights and AdamW moments, θ_global and the outer momentum
    sites = cfg.dp // rpn if cfg.outer != "none" else 0
    return {"every site's weights and optimizer": sites * sum(numels) * 12 + 8 * sum(numels)
            if sites else 0,
            "global batch": _batch_bytes(cfg),
            "one rank's logits": _logits_bytes(cfg, cfg.batch_size // (ranks * cfg.micro_batches)),
            "replica buffers": sum(numels) * _replica_bytes_per_element(cfg),
            "every rank's gradient codes": sum(_held_codes(path, n, ranks, rpn) for n in numels),
            "every rank's codec objects": ranks * (len(numels) + 2 * cfg.pp)
            * CODEC_OBJECT_BYTES}


def train_needs(cfg: TrainConfig, local_ranks: int) -> dict[str, int]:
    """Bytes the ``local_ranks`` ranks of a resolved ``train`` of ``cfg`` on this machine
    hold at least, by part (every rank draws the global batch, then keeps its rows)."""
    policy = cfg.policy_object()
    rpn = cfg.dp_ranks_per_node()
    numels = _bucket_numels(cfg, policy, cfg.dp, rpn)
    per_rank = {"global batch": _batch_bytes(cfg),
                "logits": _logits_bytes(cfg, cfg.batch_size // (cfg.dp * cfg.micro_batches)),
                # weights and the fp32 gradient buffer; masters are sharded
                "gradient buckets": sum(numels) // (cfg.tp * cfg.pp)
                * (DTYPES[cfg.dtype].itemsize + 4)}
    return {part: local_ranks * b for part, b in per_rank.items()}


def check_fits(needs: dict[str, int], device: str, sizes: str) -> None:
    """Raise :class:`InputError` naming ``sizes`` (the fields that set them) and the bound if
    ``needs`` exceeds the memory available on ``device``."""
    total, available = sum(needs.values()), available_bytes(device)
    if available is None or total <= available:
        return
    parts = ", ".join(f"{part} {_gb(b)}" for part, b in needs.items() if b)
    raise InputError(f"{sizes} needs at least {_gb(total)} of memory ({parts}); {device} has "
                     f"{_gb(available)} available; allowed: sizes whose total fits (fewer "
                     "ranks, a smaller batch, sequence or model)")


def available_bytes(device: str) -> int | None:
    """Free memory of the GPU, or of this machine (and of its cgroup, if limited)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    values = []
    with suppress(OSError), open("/proc/meminfo") as f:
        values += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    with (suppress(OSError, ValueError), open("/sys/fs/cgroup/memory.max") as f,
          open("/sys/fs/cgroup/memory.current") as g):
        limit = f.read().strip()
        if limit != "max":
            values.append(int(limit) - int(g.read()))
    return min(values) if values else None


def _bucket_numels(cfg: TrainConfig, policy: Policy, ranks: int, rpn: int) -> list[int]:
    """The padded element counts of the gradient buckets over ``ranks`` data-parallel
    ranks, as the run lays them out (a ``meta`` model: nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(config_from_preset(cfg.model, vocab_size=VOCAB_AT_LEAST))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.engine == "ddp":
        return [sum(b.numels) for b in hook_layout(
            named, BUCKET_NUMEL, lambda *_: DPBucket(policy, Topology(rpn)))]
    return [b.numel for b in build_buckets(
        named[::-1], cfg.bucket_numel, False,
        lambda: DPBucket(policy, Topology(rpn), weights=True), ranks, tensor_parallel_key)]


def _held_codes(path: GradPath, numel: int, ranks: int, rpn: int) -> int:
    """What a played reduction keeps of every rank until it ends: the codes of the last
    level (an exact reduction keeps only a running sum)."""
    levels = grad_levels(path.policy, ranks, rpn, path.axis)
    codec = path.codecs[levels[-1]]
    if ranks == 1 or is_exact(codec, path.memories[levels[-1]]):
        return 0
    per_rank = numel // rpn if len(levels) == 2 else numel
    return ranks * (codec.wire_bytes(per_rank) or 0)


def _batch_bytes(cfg: TrainConfig) -> int:
    # the batch's index grid and the gathered tokens, both int64
    return 2 * cfg.batch_size * (cfg.seq_len + 1) * TOKEN_BYTES


def _logits_bytes(cfg: TrainConfig, sequences: int) -> int:
    # fp32 logits and their gradient
    return 2 * max(1, sequences) * cfg.seq_len * VOCAB_AT_LEAST * 4


def _replica_bytes_per_element(cfg: TrainConfig) -> int:
    # weights, the fp32 gradient buffer, the fp32 master and AdamW's two moments
    return DTYPES[cfg.dtype].itemsize + 4 + 4 + 8


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
