"""Benchmarks: codec throughput and error, collective time and bytes."""
