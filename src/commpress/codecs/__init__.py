"""Codecs: encode a tensor to a :class:`Packet` of bytes and decode it back.

Importing this package registers every built-in codec; :func:`list_codecs` lists them.
"""

from commpress.codecs import (  # noqa: F401  (register)
    cast,
    chunk_topk,
    nvcomp,
    quantize,
    sign,
    topk,
    zfp,
)
from commpress.codecs.base import (
    Codec,
    Packet,
    codec,
    codec_options,
    list_codecs,
    packet_to_bytes,
    parse_spec,
    register_codec,
)
from commpress.codecs.error_feedback import ErrorFeedback

__all__ = [
    "Codec",
    "ErrorFeedback",
    "Packet",
    "codec",
    "codec_options",
    "list_codecs",
    "packet_to_bytes",
    "parse_spec",
    "register_codec",
]
