"""``commpress bench codecs``: throughput and error of every codec on one device.

For each codec: encode and decode GB/s (bytes read + written), the device-to-device
copy roofline and a ``torch.compile``d plain-PyTorch group quantizer measured in the
same run (the reference a fused kernel must beat), relative L2 error on Gaussian and
heavy-tailed (Student-t, df = 2) data, and wire bits per element.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from commpress import files
from commpress.bench.timing import median_seconds
from commpress.codecs import codec as build_codec
from commpress.kernels import reference
from commpress.validate import InputError, check_int

log = logging.getLogger(__name__)

DEFAULT_CPU = ["none", "bf16", "fp16", "fp8", "fp8:hadamard=128", "int8", "int4", "int2",
               "int2:packing=trits", "int8:hadamard=128", "int4:hadamard=128",
               "topk:ratio=0.01", "zfp:rate=8"]
DEFAULT_CUDA = [s for s in DEFAULT_CPU if not s.startswith("zfp")] + ["nvcomp:algorithm=ans"]


@dataclass
class CodecRow:
    codec: str
    device: str
    numel: int
    encode_GBps: float | None
    decode_GBps: float | None
    copy_GBps: float
    ref_encode_GBps: float | None
    ref_decode_GBps: float | None
    rel_err_gauss: float | None
    rel_err_heavy: float | None
    bits_per_elem: float | None


def student_t(numel: int, df: float, device, generator: torch.Generator) -> torch.Tensor:
    """Student-t samples (heavy tails, like gradients), all drawn from ``generator``."""
    z = torch.randn(numel, generator=generator)
    chi2 = 2.0 * torch._standard_gamma(torch.full((numel,), df / 2.0), generator=generator)
    return (z / torch.sqrt(chi2 / df)).to(device)


def _rel_err(c, x: torch.Tensor) -> float:
    y = c.decode(c.encode(x))
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def _reference_fns(spec_codec, x):
    """torch.compile'd plain-PyTorch encode/decode of the same group quantizer — a fair
    one: the Hadamard is one matrix product in the input's dtype (bf16 runs on tensor
    cores; ±1 is exact in bf16, products accumulate in fp32), built outside the traced
    function."""
    bits, group, had = spec_codec.bits, spec_codec.group, spec_codec.hadamard
    n = x.numel()
    total = reference.padded_numel(n, bits, group, had)
    H = reference.hadamard_pm1(max(had, 1), x.device).to(x.dtype)

    def encode(t):
        y = torch.nn.functional.pad(t.reshape(-1), (0, total - n))
        y = (y.view(-1, had) @ H).float().view(-1) if had else y.float()
        return reference.quantize_rotated(y, bits=bits, group=group,
                                          scale_dtype=torch.float32, keys=None)

    def decode(c, s):
        y = reference.dequantize_rotated(c, s, bits=bits, group=group)
        if had:
            y = ((y * (1.0 / had)).to(x.dtype).view(-1, had) @ H).view(-1)
        return y[:n].to(x.dtype)

    enc = torch.compile(encode, dynamic=False)
    dec = torch.compile(decode, dynamic=False)
    codes, scales = enc(x)
    return (lambda: enc(x)), (lambda: dec(codes, scales))


def bench_codecs(specs: list[str] | None = None, *, device: str = "cpu", numel: int = 1 << 22,
                 dtype: torch.dtype = torch.bfloat16, with_reference: bool = True,
                 iters: int = 10, progress=None) -> list[CodecRow]:
    check_int("numel", numel, ge=1)
    check_int("iters", iters, ge=1)
    dev = torch.device(device)
    specs = specs or (DEFAULT_CUDA if dev.type == "cuda" else DEFAULT_CPU)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g).to(device=dev, dtype=dtype)
    heavy = student_t(min(numel, 1 << 20), 2.0, dev, g).to(dtype)
    gauss = x[: heavy.numel()]
    in_bytes = numel * x.element_size()
    dst = torch.empty_like(x)
    copy_s = median_seconds(lambda: dst.copy_(x), dev, iters=iters)
    copy_gbps = 2 * in_bytes / copy_s / 1e9
    codecs = {spec: build_codec(spec) for spec in specs}  # a bad spec is an error, at once
    rows, skipped = [], []
    for spec, c in codecs.items():
        if progress:
            progress(spec)
        try:
            packet = c.encode(x)
        except (ImportError, RuntimeError) as e:  # an optional library or device is missing
            skipped.append(f"{spec} ({type(e).__name__}: {e})")
            continue
        wire = packet.nbytes
        enc_s = median_seconds(lambda c=c: c.encode(x), dev, iters=iters)
        dec_s = median_seconds(lambda c=c, p=packet: c.decode(p), dev, iters=iters)
        ref_enc = ref_dec = None
        if with_reference and getattr(c, "bit_packed", False):  # the group quantizers
            try:
                fe, fd = _reference_fns(c, x)
                ref_enc = (in_bytes + wire) / median_seconds(fe, dev, iters=iters) / 1e9
                ref_dec = (in_bytes + wire) / median_seconds(fd, dev, iters=iters) / 1e9
            except Exception as e:  # noqa: BLE001 - compile unavailable: report, keep going
                if progress:
                    progress(f"{spec}: torch.compile reference unavailable ({type(e).__name__})")
        rows.append(CodecRow(
            codec=spec, device=dev.type, numel=numel,
            encode_GBps=(in_bytes + wire) / enc_s / 1e9,
            decode_GBps=(in_bytes + wire) / dec_s / 1e9,
            copy_GBps=copy_gbps, ref_encode_GBps=ref_enc, ref_decode_GBps=ref_dec,
            rel_err_gauss=_rel_err(c, gauss), rel_err_heavy=_rel_err(c, heavy),
            bits_per_elem=8.0 * wire / numel,
        ))
    if not rows:
        raise InputError(f"no codec could run on {device}: {'; '.join(skipped)}")
    for line in skipped:
        log.warning("bench codecs: skipped %s", line)
    return rows


def print_codec_table(rows: list[CodecRow], console=None, speed: bool = True) -> None:
    """The rows as a table; ``speed=False`` leaves out the GB/s columns (too few
    iterations to mean anything, as in ``commpress demo``)."""
    from rich.table import Table

    from commpress.console import console as default_console

    console = console or default_console()
    title = f"codecs on {rows[0].device}, {rows[0].numel:,} elements"
    if speed:
        title += (f" (GB/s = bytes read + written; copy roofline "
                  f"{rows[0].copy_GBps:,.0f} GB/s; ref = torch.compile'd plain PyTorch)")
    t = Table(title=title)
    cols = ["codec", "bits/elem"]
    if speed:
        cols += ["encode GB/s", "decode GB/s", "ref encode GB/s", "ref decode GB/s"]
    cols += ["rel err Gaussian", "rel err Student-t(2)"]
    for col in cols:
        t.add_column(col, justify="left" if col == "codec" else "right")

    def fmt(v, f):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)

    for r in rows:
        cells = [r.codec, fmt(r.bits_per_elem, "{:.2f}")]
        if speed:
            cells += [fmt(r.encode_GBps, "{:,.1f}"), fmt(r.decode_GBps, "{:,.1f}"),
                      fmt(r.ref_encode_GBps, "{:,.1f}"), fmt(r.ref_decode_GBps, "{:,.1f}")]
        cells += [fmt(r.rel_err_gauss, "{:.4f}"), fmt(r.rel_err_heavy, "{:.4f}")]
        t.add_row(*cells)
    console.print(t)


def write_json(rows: list[CodecRow], path: str) -> None:
    files.write_json(path, [asdict(r) for r in rows])
