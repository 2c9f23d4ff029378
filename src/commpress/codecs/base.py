"""The codec contract: ``encode(x) -> Packet``, ``decode(packet) -> x̂``, exact wire size.

A :class:`Packet` is what crosses the wire — a tuple of tensors — plus the local
context needed to decode it (numel, shape, dtype), which the receiver of a
collective already knows and which is never sent. Nothing is pickled: a collective
moves ``packet.tensors`` as raw bytes (:func:`packet_to_bytes`) and rebuilds the
packet from bytes with :meth:`Codec.packet_from_bytes`.

Codecs are small dataclasses whose fields are their options; :func:`codec` builds
one from a name, an option string (``"int4:group=128,hadamard=128"``) or a dict, and
the registry refuses duplicate names. A codec's only mutable state is what it needs
to be reproducible (the stochastic-rounding call counter), with
``state_dict()``/``load_state_dict()`` for checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commpress.kernels.reference import saturate, sum_rows
from commpress.validate import InputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Packet:
    """An encoded tensor: ``tensors`` cross the wire; the rest is local context."""

    tensors: tuple[torch.Tensor, ...]
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of the tensors' sizes."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def finish_decode(values: torch.Tensor, packet: Packet,
                  out: torch.Tensor | None) -> torch.Tensor:
    """Return decoded flat ``values`` in the packet's shape and dtype, or copy them into
    ``out`` (the one place every codec's ``decode`` ends). Finite values beyond the
    target dtype's range saturate there (bf16 rounds 65504 up to 65536, which fp16
    cannot hold); NaN and ±Inf pass unchanged."""
    if out is not None and values.data_ptr() == out.data_ptr():
        return out  # the kernel wrote into ``out`` (see :func:`direct_out`)
    target = packet.dtype if out is None else out.dtype
    if values.dtype != target and torch.finfo(values.dtype).max > torch.finfo(target).max:
        values = saturate(values.float(), target)
    if out is None:
        return values.to(packet.dtype).view(packet.shape)
    out.copy_(values.view(out.shape))
    return out


def direct_out(packet: Packet, out: torch.Tensor | None) -> torch.Tensor | None:
    """``out`` as the flat tensor a decoder may write into directly (no allocation, no
    copy), or None when it cannot: another dtype than the packet's, or not contiguous."""
    if (out is None or out.dtype != packet.dtype or not out.is_contiguous()
            or out.numel() != packet.numel):
        return None
    return out.view(-1)


def packet_to_bytes(packet: Packet) -> torch.Tensor:
    """Concatenate a packet's tensors into one flat uint8 tensor (no pickling)."""
    parts = [t.contiguous().view(-1).view(torch.uint8) for t in packet.tensors]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts)


class Codec:
    """Base class. Subclasses are dataclasses whose fields are the codec's options.

    Class attributes: ``name`` (registry key), ``lossless``, ``fixed_rate`` (the wire
    size depends only on numel and dtype), ``supported_dtypes``, ``kernel`` (the family
    of kernels that encodes and decodes it: what measured throughputs are keyed by).
    """

    name: ClassVar[str] = ""
    kernel: ClassVar[str] = "other"
    lossless: ClassVar[bool] = False
    fixed_rate: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES

    # -- the contract ---------------------------------------------------------
    def encode(self, x: torch.Tensor, *, rng_stream: int = 0) -> Packet:
        """Encode ``x``. ``rng_stream`` separates stochastic-rounding random streams
        (a collective passes the rank, so ranks draw independent noise); it is not a
        CUDA stream: encoding runs on the current one."""
        raise NotImplementedError(f"{type(self).__name__} must implement encode")

    def decode(self, packet: Packet, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode to a tensor of the packet's shape and dtype (into ``out`` if given)."""
        raise NotImplementedError(f"{type(self).__name__} must implement decode")

    def decode_sum(self, packet: Packet) -> torch.Tensor:
        """Decode a packet of ``k`` equal chunks (shape ``(k, m)``) and sum the chunks in
        fp32, in row order → ``(m,)``. Codecs whose decode ends in a linear step (the
        inverse Hadamard) override it to take that step once, after the sum."""
        k = packet.shape[0]
        values = self.decode(Packet(packet.tensors, packet.numel, packet.shape, torch.float32))
        return sum_rows(values.view(k, -1))

    def requantizes_into(self, other: Codec) -> bool:
        """Whether :meth:`sum_requantize` can re-encode this codec's packets as ``other``'s
        without decoding to plain values (same rotation, bit-packed codes)."""
        return False

    def sum_requantize(self, packet: Packet, into: Codec, *, rng_stream: int = 0) -> Packet:
        """Sum the ``k`` chunks of ``packet`` and encode the sum with ``into`` in one fused
        step (the middle of a two-level reduce-scatter); see :meth:`requantizes_into`."""
        raise NotImplementedError(f"{self.spec()} cannot re-encode into {into.spec()} directly")

    def packet_layout(self, numel: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        """``(dtype, count)`` of each packet tensor, for fixed-rate codecs."""
        raise NotImplementedError(f"{type(self).__name__} is variable-rate: no fixed layout")

    @property
    def alignment(self) -> int:
        """Element count ``a`` such that the packet of ``n·a`` elements splits, tensor by
        tensor, into ``n`` equal packets that each decode one piece of ``a`` elements:
        a collective encodes once and sends each destination its slice. 0 means the
        packet cannot be split (encode each piece on its own). Default: 1 for a
        fixed-rate codec, 0 for a variable-rate one."""
        return 1 if self.fixed_rate else 0

    # -- derived --------------------------------------------------------------
    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        """Exact bytes the packet of ``numel`` elements puts on the wire (None if variable)."""
        if not self.fixed_rate:
            return None
        return sum(count * itemsize(dt) for dt, count in self.packet_layout(numel, dtype))

    def bits_per_element(self, numel: int, dtype: torch.dtype = torch.float32) -> float | None:
        wb = self.wire_bytes(numel, dtype)
        return None if wb is None or numel == 0 else 8.0 * wb / numel

    def packet_from_bytes(
        self, buf: torch.Tensor, numel: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Packet:
        """Rebuild a packet from the bytes of :func:`packet_to_bytes`."""
        if not self.fixed_rate:
            return Packet((buf,), numel, tuple(shape), dtype)
        tensors, offset = [], 0
        for dt, count in self.packet_layout(numel, dtype):
            nbytes = count * itemsize(dt)
            part = buf[offset : offset + nbytes]
            if part.storage_offset() % itemsize(dt):
                part = part.clone()  # a byte slice must be aligned to be viewed as ``dt``
            tensors.append(part.view(dt))
            offset += nbytes
        if offset != buf.numel():
            raise InputError(
                f"{self.spec()}: got {buf.numel()} bytes for {numel} elements, expected {offset}"
            )
        return Packet(tuple(tensors), numel, tuple(shape), dtype)

    def check_input(self, x: torch.Tensor) -> None:
        if x.dtype not in self.supported_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise InputError(
                f"codec {self.name!r} does not support dtype "
                f"{str(x.dtype).removeprefix('torch.')}; allowed: {allowed}"
            )

    def spec(self) -> str:
        """Canonical option string, e.g. ``"int4:group=128,hadamard=0,..."`` (all options)."""
        opts = [f"{f.name}={_format(getattr(self, f.name))}" for f in _option_fields(type(self))]
        return self.name + (":" + ",".join(opts) if opts else "")

    def to_dict(self) -> dict[str, Any]:
        options = {f.name: getattr(self, f.name) for f in _option_fields(type(self))}
        return {"name": self.name, **options}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise InputError(f"codec {self.name!r} has no state; got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"codec({self.spec()!r})"


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def _format(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _option_fields(cls: type) -> list[dataclasses.Field]:
    if not dataclasses.is_dataclass(cls):
        return []
    return [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


@functools.cache
def _option_types(cls: type) -> dict[str, Any]:
    # resolving the string annotations compiles each one: 0.7 ms, once per class
    return typing.get_type_hints(cls)


# -- registry -------------------------------------------------------------------

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: add a codec under ``cls.name``; a duplicate name is an error."""
    if not cls.name:
        raise InputError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    if cls.name in _REGISTRY:
        raise InputError(f"codec name {cls.name!r} is already registered by "
                         f"{_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def list_codecs() -> list[str]:
    """Names of all registered codecs."""
    return sorted(_REGISTRY)


def codec_options(name: str) -> dict[str, Any]:
    """Option names of codec ``name`` with their defaults."""
    cls = _lookup(name)
    return {f.name: (f.default if f.default is not dataclasses.MISSING else None)
            for f in _option_fields(cls)}


def _lookup(name: str) -> type[Codec]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InputError(
            f"unknown codec {name!r}; allowed: {', '.join(list_codecs())}"
        ) from None


def parse_spec(spec: str) -> dict[str, Any]:
    """``"int4:group=128,hadamard=128"`` → ``{"name": "int4", "group": "128", ...}``."""
    name, _, rest = spec.strip().partition(":")
    out: dict[str, Any] = {"name": name.strip()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(
                f"codec spec {spec!r}: option {item!r} is not of the form key=value"
            )
        if key in out:
            raise InputError(f"codec spec {spec!r}: option {key!r} is given twice; allowed: "
                             "each option once")
        out[key] = value.strip()
    return out


def codec(spec: str | dict[str, Any] | Codec, **options: Any) -> Codec:
    """Build a codec from a name, an option string or a dict; ``options`` override.

    Example::

        codec("int4:group=128,hadamard=128,rounding=stochastic,seed=3")
        codec({"name": "int8", "group": 64})
        codec("int4", group=256)
    """
    if isinstance(spec, Codec):
        return codec({**spec.to_dict(), **options}) if options else spec
    if isinstance(spec, str):
        d = parse_spec(spec)
    elif isinstance(spec, dict):
        d = dict(spec)
    else:
        raise InputError(f"codec spec must be a str, dict or Codec; got {type(spec).__name__}")
    d.update(options)
    if "name" not in d:
        raise InputError(f"codec dict {spec!r} has no 'name'; allowed names: "
                         f"{', '.join(list_codecs())}")
    name = d.pop("name")
    cls = _lookup(str(name))
    fields = {f.name: f for f in _option_fields(cls)}
    hints = _option_types(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            allowed = ", ".join(fields) or "(none)"
            raise InputError(f"codec {name!r} has no option {key!r}; allowed: {allowed}")
        kwargs[key] = _coerce(name, key, value, hints[key])
    return cls(**kwargs)


def _coerce(codec_name: str, key: str, value: Any, hint: Any) -> Any:
    """Convert an option value (often a string from a spec) to the field's type."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise InputError(f"codec {codec_name!r}: {key}={value!r} is not allowed; "
                             f"allowed: {', '.join(map(str, allowed))}")
        return value
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise InputError(value)
                return value.lower() in ("true", "1")
            return bool(value)
        if hint is int:
            if isinstance(value, float) and not value.is_integer():
                raise InputError(value)
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            return str(value)
    except (TypeError, ValueError):
        raise InputError(f"codec {codec_name!r}: {key}={value!r} is not a valid "
                         f"{getattr(hint, '__name__', hint)}") from None
    return value


def option_error(codec_name: str, key: str, value: Any, allowed: str) -> InputError:
    """A uniform message for a bad option value."""
    return InputError(f"codec {codec_name!r}: {key}={value!r} is not allowed; {allowed}")


__all__ = [
    "FLOAT_DTYPES",
    "Codec",
    "Packet",
    "codec",
    "codec_options",
    "list_codecs",
    "option_error",
    "packet_to_bytes",
    "parse_spec",
    "register_codec",
    "sum_rows",
]
