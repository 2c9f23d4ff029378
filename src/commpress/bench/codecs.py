"""``commpress bench codecs``: throughput and error of every codec on one device.

For each codec: encode and decode GB/s (bytes read + written), the device-to-device
copy roofline and a ``torch.compile``d plain-PyTorch group quantizer measured in the
same run (the reference a fused kernel must beat), relative L2 error on Gaussian and
heavy-tailed (Student-t, df = 2) data, and wire bits per element.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from commpress.bench.timing import median_seconds
from commpress.codecs import codec as build_codec
from commpress.kernels import reference

DEFAULT_CPU = ["none", "bf16", "fp16", "fp8", "int8", "int4", "int2", "int8:hadamard=128",
               "int4:hadamard=128", "topk:ratio=0.01", "zfp:rate=8"]
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
    z = torch.randn(numel, generator=generator)
    chi2 = 2.0 * torch._standard_gamma(torch.full((numel,), df / 2.0))
    return (z / torch.sqrt(chi2 / df)).to(device)


def _rel_err(c, x: torch.Tensor) -> float:
    y = c.decode(c.encode(x))
    return ((y.double() - x.double()).norm() / x.double().norm()).item()


def _reference_fns(spec_codec, x):
    """torch.compile'd plain-PyTorch encode/decode of the same group quantizer."""
    bits, group, had = spec_codec.bits, spec_codec.group, spec_codec.hadamard
    enc = torch.compile(lambda t: reference.quantize(t, bits=bits, group=group, hadamard=had),
                        dynamic=False)
    codes, scales = enc(x)
    dec = torch.compile(lambda c, s: reference.dequantize(c, s, x.numel(), bits=bits, group=group,
                                                          hadamard=had, out_dtype=x.dtype),
                        dynamic=False)
    return (lambda: enc(x)), (lambda: dec(codes, scales))


def bench_codecs(specs: list[str] | None = None, *, device: str = "cpu", numel: int = 1 << 22,
                 dtype: torch.dtype = torch.bfloat16, with_reference: bool = True,
                 iters: int = 10, progress=None) -> list[CodecRow]:
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
    rows = []
    for spec in specs:
        if progress:
            progress(spec)
        try:
            c = build_codec(spec)
            packet = c.encode(x)
        except (ImportError, ValueError) as e:
            if progress:
                progress(f"{spec}: skipped ({e})")
            continue
        wire = packet.nbytes
        enc_s = median_seconds(lambda c=c: c.encode(x), dev, iters=iters)
        dec_s = median_seconds(lambda c=c, p=packet: c.decode(p), dev, iters=iters)
        ref_enc = ref_dec = None
        if with_reference and hasattr(c, "bits"):
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
    return rows


def print_codec_table(rows: list[CodecRow], console=None) -> None:
    from rich.table import Table

    from commpress.console import console as default_console

    console = console or default_console()
    if not rows:
        console.print("no codec rows")
        return
    t = Table(title=f"codecs on {rows[0].device}, {rows[0].numel:,} elements "
                    f"(copy roofline {rows[0].copy_GBps:,.0f} GB/s)")
    for col in ("codec", "bits/elem", "encode GB/s", "decode GB/s", "ref enc", "ref dec",
                "rel err gauss", "rel err t(2)"):
        t.add_column(col, justify="left" if col == "codec" else "right")
    fmt = lambda v, f: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)  # noqa: E731
    for r in rows:
        t.add_row(r.codec, fmt(r.bits_per_elem, "{:.2f}"), fmt(r.encode_GBps, "{:,.1f}"),
                  fmt(r.decode_GBps, "{:,.1f}"), fmt(r.ref_encode_GBps, "{:,.1f}"),
                  fmt(r.ref_decode_GBps, "{:,.1f}"), fmt(r.rel_err_gauss, "{:.4f}"),
                  fmt(r.rel_err_heavy, "{:.4f}"))
    console.print(t)


def write_json(rows: list[CodecRow], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
