"""The data-parallel core every data-parallel front-end and engine adapter holds: one
bucket's codecs and their state (:class:`DPBucket`), its gradient path
(:class:`GradPath`: one level or two, decided from the topology) and how the new weights
reach every replica (:mod:`commpress.dp.weight_gather`)."""

from commpress.dp.bucket import DPBucket, needs_node_levels
from commpress.dp.grad_path import GradPath, grad_levels, make_levels_now

__all__ = ["DPBucket", "GradPath", "grad_levels", "make_levels_now", "needs_node_levels"]
