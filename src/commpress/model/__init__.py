"""Models used by the reference trainer and the tests."""

from commpress.model.gpt import GPT, GPTConfig, list_presets

__all__ = ["GPT", "GPTConfig", "list_presets"]
