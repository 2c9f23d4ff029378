"""commpress: compressed communication for distributed LLM training.

Public API::

    import commpress
    c = commpress.codec("int4:group=128,hadamard=128")
    packet = c.encode(x); x_hat = c.decode(packet)
"""

from commpress.codecs import (
    Codec,
    Delta,
    ErrorFeedback,
    Packet,
    codec,
    list_codecs,
)

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "Delta",
    "ErrorFeedback",
    "Packet",
    "__version__",
    "codec",
    "list_codecs",
]
