"""Text data for the reference trainer: byte-level tokens, deterministic split and batches.

Sources, by ``path``:

* ``None`` — the Python standard library's own source files on this machine (a few
  MB of real text, present wherever Python is): sorted, concatenated, byte tokens;
* a text file, or a folder of ``.txt``/``.md``/``.py`` files — byte tokens;
* a ``.bin`` file — pre-tokenized ``uint16`` tokens (nanoGPT format).

The last ``val_fraction`` of the tokens is the validation split. A batch is a function
of (seed, step) only — every data-parallel rank computes the same global batch and
takes its rows — so a run is reproducible and its loss curve does not depend on the
parallel layout.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np
import torch

from commpress.files import open_regular
from commpress.validate import InputError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def _stdlib_files() -> list[str]:
    root = os.path.dirname(os.__file__)
    return sorted(glob.glob(os.path.join(root, "*.py")))


def load_tokens(path: str | None = None, max_bytes: int | None = 4 << 20) -> torch.Tensor:
    """Tokens of the corpus as a 1-D int64 tensor (see the module doc for sources): at
    most ``max_bytes`` bytes read, of regular files only (a FIFO or ``/dev/zero`` named
    by ``path`` is refused)."""
    if path is None:
        files = _stdlib_files()
        if not files:
            raise InputError("no default corpus: the Python standard library sources were not "
                             "found; pass --data PATH")
    elif not os.path.exists(path):
        raise InputError(f"data path {path!r} does not exist; allowed: a text file, a folder "
                         f"of {', '.join(TEXT_SUFFIXES)} files, or a uint16 .bin file")
    elif os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if f.endswith(TEXT_SUFFIXES) and os.path.isfile(f))
        if not files:
            raise InputError(f"data folder {path!r} holds no {', '.join(TEXT_SUFFIXES)} files")
    elif path.endswith(".bin"):
        # read at most max_bytes: a multi-GB corpus costs only what is used
        raw = _read_prefix(path, max_bytes, "--data")
        arr = np.frombuffer(raw, dtype=np.uint16, count=len(raw) // 2)
        tokens = torch.from_numpy(arr.astype(np.int64))
        if tokens.numel() == 0:
            raise InputError(f"the corpus {path!r} is empty")
        return tokens
    else:
        files = [path]
    chunks, total = [], 0
    for f in files:
        left = None if max_bytes is None else max_bytes - total
        chunks.append(_read_prefix(f, left, "--data" if f == path else "corpus file"))
        total += len(chunks[-1])
        if max_bytes is not None and total >= max_bytes:
            break
    raw = b"".join(chunks)
    if not raw:
        raise InputError(f"the corpus {path or 'the standard library'!r} is empty")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def _read_prefix(path: str, max_bytes: int | None, what: str) -> bytes:
    """The first ``max_bytes`` bytes of regular file ``path`` (all of it for None, as
    long as it was when opened)."""
    f, size = open_regular(path, what)
    with f:
        return f.read(size if max_bytes is None else min(size, max_bytes))


@dataclass
class TextData:
    """Train/validation token streams and a seeded batch sampler."""

    tokens: torch.Tensor
    val_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise InputError(f"val_fraction={self.val_fraction} is not allowed; allowed: (0, 1)")
        n_val = max(2, int(len(self.tokens) * self.val_fraction))
        self.train = self.tokens[:-n_val]
        self.val = self.tokens[-n_val:]

    @property
    def vocab_size(self) -> int:
        return int(self.tokens.max().item()) + 1

    def check_seq_len(self, seq_len: int) -> None:
        shortest = min(len(self.train), len(self.val))
        if seq_len + 1 > shortest:
            raise InputError(f"sequence length {seq_len} is longer than the data allows: the "
                             f"smaller split has {shortest} tokens; allowed: seq_len <= "
                             f"{shortest - 1} (use more data or a shorter --seq-len)")

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int,
              step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch ``(x, y)`` of ``batch_size`` sequences for (seed, step)."""
        stream = {"train": self.train, "val": self.val}.get(split)
        if stream is None:
            raise InputError(f"split={split!r} is not allowed; allowed: train, val")
        self.check_seq_len(seq_len)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        seqs = stream[idx]
        return seqs[:, :-1], seqs[:, 1:]

    def fingerprint(self) -> str:
        """SHA-256 of the tokens: the same corpus (and byte limit) gives the same value."""
        import hashlib

        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()

    def unigram_entropy(self) -> float:
        """Entropy of the byte distribution of the training split, in nats per token."""
        counts = torch.bincount(self.train, minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())
