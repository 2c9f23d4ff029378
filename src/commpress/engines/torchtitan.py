"""torchtitan integration: compress a torchtitan model's FSDP2 traffic (HSDP included).

torchtitan shards its models with FSDP2 (``apply_fsdp_to_decoder`` in
``torchtitan.distributed.fsdp``; a 2-D ``["dp_replicate", "fsdp"]`` mesh when
``data_parallel_replicate_degree > 1`` is HSDP). :func:`compress` installs commpress's
collectives on those FSDP modules: call it at the end of the model's parallelize step
(after ``apply_fsdp_to_decoder``) or on the trainer's ``model_parts`` once built::

    model = parallelize_llama(model, parallel_dims=..., ...)
    comm = commpress.torchtitan.compress(model, "sdp4bit")

torchtitan's trainer sets FSDP's gradient divide factor to 1.0 (it scales by the token
count itself); the compressed reduce-scatter and replicate all-reduce honour it.

The codec state (error-feedback residuals, rounding counters) is a DCP ``Stateful``:
add it to the checkpointer's states so it is saved and loaded with the model::

    trainer.checkpointer.states["commpress"] = comm

Resuming on another number of ranks (torchtitan's checkpoints reshard through DCP), put
``comm.elastic()`` there instead: the codecs then start fresh, said once. ``comm.remove()``
gives FSDP its own collectives back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
import torchtitan  # noqa: F401  (the engine this adapter is for: missing means an ImportError)

from commpress.collectives import Topology
from commpress.engines import fsdp
from commpress.engines.fsdp import FSDPCompression
from commpress.policy import Policy
from commpress.validate import InputError


def compress(model: nn.Module | Sequence[nn.Module], policy: str | dict | Policy = "sdp4bit",
             topology: Topology | None = None) -> fsdp.FSDPCompression:
    """Compress the FSDP2 collectives of a torchtitan model (or its ``model_parts``,
    pipeline stages) by ``policy``; returns the :class:`FSDPCompression` to checkpoint.

    The FSDP modules are named as in ``model.named_modules()``; with several model parts,
    prefixed by the part's index (``"0.layers.1"``).
    """
    if isinstance(model, nn.Module):
        return fsdp.compress(model, policy, topology)
    parts = list(model)
    if not parts or not all(isinstance(p, nn.Module) for p in parts):
        raise InputError("commpress.torchtitan.compress: model must be an nn.Module or a "
                         f"non-empty list of them (model_parts); got {model!r}")
    return fsdp.compress(nn.ModuleList(parts), policy, topology)


__all__ = ["FSDPCompression", "compress"]
