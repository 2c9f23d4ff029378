"""A small GPT in the nanoGPT spirit: decoder-only, pre-norm, causal attention through
``scaled_dot_product_attention``, GELU MLP, and an output head of its own (untied
from the input embedding, so pipeline stages never share a weight).

The attention and MLP projections are plain ``nn.Linear`` modules with Megatron's
names (``qkv``/``proj``, ``fc``/``out``), so tensor parallelism can swap them for
column- and row-parallel versions (:mod:`commpress.parallel.tensor`) without
touching this file. ``n_head`` counts heads of the *local* module: a tensor-parallel
rank holds ``n_head / tp`` heads.

With ``n_expert > 0`` each block's MLP is a mixture of experts
(:class:`~commpress.model.moe.MoE`: top-k routing, dropless grouped matmul), whose
experts expert parallelism spreads over ranks (:mod:`commpress.parallel.expert`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from commpress.model.moe import MoE
from commpress.validate import InputError


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``vocab_size`` 256 is the byte-level tokenizer."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    n_expert: int = 0  # 0: a dense MLP; else a mixture of this many experts per block
    top_k: int = 2  # experts per token (with n_expert > 0)
    expert_hidden: int = 0  # each expert's hidden width; 0: 2 · n_embd
    aux_loss_coef: float = 0.01  # Switch Transformer's load-balancing loss, per forward

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "top_k"):
            if getattr(self, name) < 1:
                raise InputError(f"GPTConfig.{name}={getattr(self, name)} is not allowed; "
                                 "allowed: a positive integer")
        for name in ("n_expert", "expert_hidden"):
            if getattr(self, name) < 0:
                raise InputError(f"GPTConfig.{name}={getattr(self, name)} is not allowed; "
                                 "allowed: an integer >= 0")
        if self.n_embd % self.n_head:
            raise InputError(f"GPTConfig: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}")
        if self.n_expert and self.top_k > self.n_expert:
            raise InputError(f"GPTConfig: top_k={self.top_k} is not allowed with "
                             f"n_expert={self.n_expert}; allowed: 1 to n_expert")
        if not self.aux_loss_coef >= 0:
            raise InputError(f"GPTConfig.aux_loss_coef={self.aux_loss_coef} is not allowed; "
                             "allowed: a number >= 0")

    @property
    def moe(self) -> bool:
        return self.n_expert > 0

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width."""
        return self.expert_hidden or 2 * self.n_embd

    def mlp_params(self) -> int:
        """One block's MLP: dense (fc, out with biases) or router and experts."""
        d = self.n_embd
        if self.moe:
            return self.n_expert * d + self.n_expert * 2 * d * self.expert_width
        return 8 * d * d + 5 * d

    def num_params(self) -> int:
        d, v, t = self.n_embd, self.vocab_size, self.block_size
        per_layer = 4 * d * d + 8 * d + self.mlp_params()  # attention, norms, MLP
        return 2 * v * d + t * d + self.n_layer * per_layer + 2 * d

    def to_dict(self) -> dict:
        return asdict(self)


# ~1M parameters for CI up to GPT-2 XL-like sizes for GPUs (byte vocabulary: the
# embedding is tiny, so the count is almost all transformer blocks).
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "gpt-1m": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt-3m": GPTConfig(n_layer=6, n_head=6, n_embd=192, block_size=128),
    "gpt-10m": GPTConfig(n_layer=8, n_head=8, n_embd=320, block_size=256),
    "gpt-125m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt-350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt-1.3b": GPTConfig(n_layer=24, n_head=32, n_embd=2048, block_size=2048),
    # mixtures of experts: 8 experts, top-2 (each expert half a dense MLP's width, so a
    # token's active MLP compute equals the dense model's)
    "moe-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, n_expert=8),
    "moe-3m": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, n_expert=8),
    "moe-256m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, n_expert=8),
}


def list_presets() -> list[str]:
    return list(PRESETS)


def config_from_preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name].to_dict(), **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, 3 · local heads · head_dim)
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg.n_embd, cfg.expert_width, cfg.n_expert, cfg.top_k,
                       cfg.aux_loss_coef) if cfg.moe else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings → blocks → final norm → output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 initialization; residual projections scaled by 1/√(2·n_layer)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith(("proj.weight", "out.weight", "mlp.w_out")):
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise InputError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.wte(idx) + self.wpe(pos)  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
