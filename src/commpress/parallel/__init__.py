"""Tensor, pipeline and data parallelism for the reference GPT."""
