"""commpress's own data-parallel front-ends: the sharded optimizer, the DDP hooks, DiLoCo
and their played twins. Engine adapters are in :mod:`commpress.engines`, the
data-parallel core they all hold in :mod:`commpress.dp`."""

from commpress.dp.grad_path import GradPath
from commpress.frontends.ddp import DDPHookState, compressed_allreduce_hook, ddp_hook
from commpress.frontends.ddp_lowrank import LowRankConfig, lowrank_hook
from commpress.frontends.diloco import OUTER_PRESETS, DiLoCo
from commpress.frontends.sharded_optimizer import NonFiniteGradientError, ShardedOptimizer

__all__ = ["OUTER_PRESETS", "DDPHookState", "DiLoCo", "GradPath", "LowRankConfig",
           "NonFiniteGradientError", "ShardedOptimizer", "compressed_allreduce_hook", "ddp_hook",
           "lowrank_hook"]
