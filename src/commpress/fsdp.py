"""``commpress.fsdp``: FSDP2 custom collectives (see :mod:`commpress.integrations.fsdp`)."""

from commpress.integrations.fsdp import (
    CompressedAllGather,
    CompressedReduceScatter,
    compress,
)

__all__ = ["CompressedAllGather", "CompressedReduceScatter", "compress"]
