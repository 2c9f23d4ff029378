"""Integrations: the sharded optimizer, the DDP hook, FSDP2 (``commpress.fsdp``)."""

from commpress.integrations.ddp import DDPHookState, compressed_allreduce_hook, ddp_hook
from commpress.integrations.sharded_optimizer import NonFiniteGradientError, ShardedOptimizer

__all__ = ["DDPHookState", "NonFiniteGradientError", "ShardedOptimizer",
           "compressed_allreduce_hook", "ddp_hook"]
