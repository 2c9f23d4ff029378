"""commpress: compressed communication for distributed LLM training.

Public API::

    import commpress
    c = commpress.codec("int4:group=128,hadamard=128")
    packet = c.encode(x); x_hat = c.decode(packet)
"""

import importlib
import importlib.abc
import importlib.util
import sys

from commpress import ep
from commpress.codecs import (
    Codec,
    ErrorFeedback,
    Packet,
    codec,
    list_codecs,
)
from commpress.collectives import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    Handle,
    P2POp,
    Topology,
    Watch,
    all_gather,
    all_reduce,
    all_to_all,
    batch_isend_irecv,
    delta_all_gather,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    irecv,
    isend,
    recv,
    reduce_scatter,
    reduce_scatter_parts,
    reset_stats,
    send,
    stats,
)
from commpress.engines.rank_state import load as load_rank_state
from commpress.engines.rank_state import save as save_rank_state
from commpress.frontends import (
    DDPHookState,
    DiLoCo,
    NonFiniteGradientError,
    ShardedOptimizer,
    ddp_hook,
    lowrank_hook,
)
from commpress.policy import Policy, Rule, list_presets
from commpress.validate import InputError

__version__ = "0.1.0"

# Adapters that import their engine load on first use (``commpress.megatron``); FSDP2's
# import pulls in DTensor, which would double the time every process takes to start.
_ENGINES = {"fsdp": "commpress.engines.fsdp",
            "megatron": "commpress.engines.megatron",
            "deepspeed": "commpress.engines.deepspeed",
            "lightning": "commpress.engines.lightning",
            "torchtitan": "commpress.engines.torchtitan",
            "diloco": "commpress.frontends.diloco",
            "torchft": "commpress.engines.torchft",
            "transformers": "commpress.engines.transformers"}


def __getattr__(name: str):
    if name in _ENGINES:
        return importlib.import_module(_ENGINES[name])
    raise AttributeError(f"module 'commpress' has no attribute {name!r}")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import commpress.megatron`` and ``from commpress.deepspeed import compress`` load
    the adapter's module itself (one module object, whichever name imported it first)."""

    def find_spec(self, fullname, path, target=None):
        name = fullname.removeprefix("commpress.")
        if fullname.startswith("commpress.") and name in _ENGINES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(_ENGINES[spec.name.removeprefix("commpress.")])

    def exec_module(self, module) -> None:
        pass  # executed by its own import


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.append(_Alias())


__all__ = [
    "ep",
    "DDPHookState",
    "DiLoCo",
    "InputError",
    "NonFiniteGradientError",
    "Policy",
    "Rule",
    "ShardedOptimizer",
    "ddp_hook",
    "lowrank_hook",
    "load_rank_state",
    "save_rank_state",
    "fsdp",
    "list_presets",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Handle",
    "P2POp",
    "Topology",
    "all_gather",
    "all_to_all",
    "all_reduce",
    "batch_isend_irecv",
    "delta_all_gather",
    "hierarchical_all_gather",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter",
    "reduce_scatter_parts",
    "reset_stats",
    "Watch",
    "send",
    "stats",
    "Codec",
    "ErrorFeedback",
    "Packet",
    "__version__",
    "codec",
    "list_codecs",
]
