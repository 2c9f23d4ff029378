"""Model presets for planning: layer count, hidden size, heads, vocabulary, parameters.

GPT sizes follow GPT-3 (Brown et al., 2020, Table 2.1) and the SDP4Bit runs; GPT-NeoX-20B
(Black et al., 2022); Llama 2 (Touvron et al., 2023). Parameters are computed from the
shapes (12·L·h² + embeddings), which lands within a few percent of the nominal size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commpress.validate import InputError


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    ffn_mult: float = 4.0
    params_override: float | None = None  # nominal count when the shape formula is off
    # a mixture of experts: every layer's MLP is ``experts`` experts of width
    # ``expert_ffn_mult · hidden``, ``top_k`` per token; ``mlp_matrices`` 3 for SwiGLU
    experts: int = 0
    top_k: int = 1
    expert_ffn_mult: float = 0.0
    mlp_matrices: int = 2

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_params(self) -> float:
        """All layers' expert weights (0 for a dense model)."""
        one = self.mlp_matrices * self.expert_ffn_mult * self.hidden * self.hidden
        return self.layers * self.experts * one

    @property
    def params(self) -> float:
        if self.params_override:
            return self.params_override
        h = self.hidden
        mlp = (self.experts * h + self.expert_params / self.layers if self.moe
               else self.mlp_matrices * self.ffn_mult * h * h)
        per_layer = 4 * h * h + mlp + 13 * h
        return self.layers * per_layer + self.vocab * h

    @property
    def active_params(self) -> float:
        """The weights one token's forward multiplies by: ``top_k`` experts, not all."""
        if not self.moe:
            return self.params
        return self.params - self.expert_params * (1 - self.top_k / self.experts)


MODELS: dict[str, ModelShape] = {
    "gpt-125m": ModelShape(12, 768, 12),
    "gpt-350m": ModelShape(24, 1024, 16),
    "gpt-760m": ModelShape(24, 1536, 16),
    "gpt-1.3b": ModelShape(24, 2048, 32),
    "gpt-2.7b": ModelShape(32, 2560, 32),
    "gpt-6.7b": ModelShape(32, 4096, 32),
    "gpt-13b": ModelShape(40, 5140, 40),
    "gpt-18b": ModelShape(40, 6144, 48),
    "gpt-neox-20b": ModelShape(44, 6144, 64, vocab=50432),
    "llama-7b": ModelShape(32, 4096, 32, vocab=32000, params_override=6.74e9),
    "llama-13b": ModelShape(40, 5120, 40, vocab=32000, params_override=13.0e9),
    "llama-70b": ModelShape(80, 8192, 64, vocab=32000, params_override=69.0e9),
    # mixtures of experts (attention counted as full multi-head: a few % high for GQA)
    "moe-256m": ModelShape(12, 768, 12, vocab=256, experts=8, top_k=2, expert_ffn_mult=2.0),
    "mixtral-8x7b": ModelShape(32, 4096, 32, vocab=32000, experts=8, top_k=2,
                               expert_ffn_mult=3.5, mlp_matrices=3),
    "qwen3-30b-a3b": ModelShape(48, 2048, 32, vocab=151936, experts=128, top_k=8,
                                expert_ffn_mult=0.375, mlp_matrices=3),
}


def model_from_arg(arg: str) -> ModelShape:
    """A preset name, or a parameter count ("6.7e9", "350M", "1.3B")."""
    if arg in MODELS:
        return MODELS[arg]
    text = arg.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:], 1.0)
    try:
        n = float(text[:-1] if scale != 1.0 else text) * scale
        if not (math.isfinite(n) and n >= 1):  # nan, inf, 0 and negatives have no shape
            raise InputError(arg)
    except ValueError:
        raise InputError(f"--model {arg!r} is not a preset or a parameter count; allowed: "
                         f"{', '.join(MODELS)}, or a positive number such as 6.7e9 or "
                         "1.3B") from None
    # a GPT-like shape for that count: h from 12·L·h² with L ≈ h / 128
    hidden = int(round((n * 128 / 12) ** (1 / 3) / 128)) * 128 or 128
    layers = max(1, int(round(n / (12 * hidden * hidden))))
    return ModelShape(layers, hidden, max(1, hidden // 128), params_override=n)
