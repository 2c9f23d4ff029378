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

    @property
    def params(self) -> float:
        if self.params_override:
            return self.params_override
        mlp = 2 * self.ffn_mult * self.hidden * self.hidden
        per_layer = 4 * self.hidden * self.hidden + mlp + 13 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden


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
