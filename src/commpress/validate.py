"""Checks of user input, shared by the configs, the CLI and the public API.

:class:`InputError` is what commpress raises for input it refuses. A bad number gets one
naming the argument, the value and the allowed
range. NaN and ±Inf are never in range: ``float("nan")`` passes every comparison-based
check (``nan < 0`` is False), and a NaN learning rate turns every weight to NaN at the
first step while the run goes on, skipping every later step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

MAX_SEED = 2**32 - 1  # the largest seed taken (as numpy takes them)


class InputError(ValueError):
    """Input that commpress refuses (an option, a config field, a file, a checkpoint); the
    message names the field, the value and what is allowed.

    The CLI prints it as one line and exits with code 2; any other exception, a
    ``ValueError`` from a bug included, keeps its traceback. A subclass of ``ValueError``,
    so ``except ValueError`` still catches it.
    """


def check_int(name: str, value: object, *, ge: int | None = None, le: int | None = None,
              optional: bool = False) -> None:
    """Raise :class:`InputError` unless ``value`` is an integer (not a bool) in ``[ge, le]``
    (or None when ``optional``).

    Example::

        check_int("steps", cfg.steps, ge=1)  # steps=0 is not allowed; allowed: an integer >= 1
    """
    if value is None and optional:
        return
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and (ge is None or value >= ge) and (le is None or value <= le):
        return
    raise InputError(f"{name}={value!r} is not allowed; allowed: "
                     f"{_allowed('an integer', _range(ge=ge, le=le), optional)}")


def check_float(name: str, value: object, *, gt: float | None = None, ge: float | None = None,
                lt: float | None = None, le: float | None = None,
                optional: bool = False) -> None:
    """Raise :class:`InputError` unless ``value`` is a finite real number within the bounds
    (``gt``/``ge`` below, ``lt``/``le`` above), or None when ``optional``.

    Example::

        check_float("min_lr_ratio", 0.1, ge=0, le=1)
    """
    if value is None and optional:
        return
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value)
          and (gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt) and (le is None or value <= le))
    if ok:
        return
    raise InputError(f"{name}={value!r} is not allowed; allowed: "
                     f"{_allowed('a finite number', _range(gt=gt, ge=ge, lt=lt, le=le), optional)}")


def check_bool(name: str, value: object) -> None:
    """Raise :class:`InputError` unless ``value`` is ``True`` or ``False`` (``"no"`` would
    otherwise switch a mode on)."""
    if not isinstance(value, bool):
        raise InputError(f"{name}={value!r} is not allowed; allowed: True or False")


def check_path(name: str, value: object, *, optional: bool = False) -> None:
    """Raise :class:`InputError` unless ``value`` is a non-blank path string (or None when
    ``optional``): an empty ``--resume "$CKPT"`` from an unset variable must not start a
    fresh run, nor an empty ``--json`` write nothing, in silence.
    """
    if value is None and optional:
        return
    if isinstance(value, str) and value.strip():
        return
    raise InputError(f"{name}={value!r} is not allowed; allowed: "
                     f"{_allowed('a non-empty path', '', optional)}")


def _allowed(kind: str, bounds: str, optional: bool) -> str:
    return " ".join(part for part in (kind, bounds, "or none" if optional else "") if part)


def _range(*, gt=None, ge=None, lt=None, le=None) -> str:
    """``'>= 1'``, ``'< 1'``, ``'in [0, 1]'``, ``'in (0, 1000000]'`` (empty: unbounded)."""
    low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else None
    high = f"{lt})" if lt is not None else f"{le}]" if le is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"> {gt}" if gt is not None else f">= {ge}"
    if high:
        return f"< {lt}" if lt is not None else f"<= {le}"
    return ""


def check_saved_state(state: object, fmt: str, what: str, mine: dict[str, object],
                      advice: str, views: dict[str, Callable] | None = None,
                      formats: dict[str, str] | None = None) -> None:
    """Refuse a saved state that is not a dict of format ``fmt`` (``what`` names its kind;
    ``formats`` says what each other known format is and how to load it), or whose fields
    ``mine`` — read through ``views[key]`` where given — differ from this run's: the
    message names the first field that differs (inside a dict, its first key that
    differs), both values and ``advice``."""
    if not isinstance(state, dict) or state.get("format") != fmt:
        found = state.get("format") if isinstance(state, dict) else None
        known = (formats or {}).get(found) if isinstance(found, str) else None
        if known:
            raise InputError(f"not a {what} state: its format {found!r} is {known} "
                             f"(expected format {fmt!r})")
        raise InputError(f"not a {what} state (expected format {fmt!r}"
                         + (f"; found {found!r})" if found is not None else ")"))
    views = views or {}
    for key, value in mine.items():
        if key not in state:
            raise InputError(f"{what} checkpoint has no {key!r}; {advice}")
        saved = views[key](state[key]) if key in views else state[key]
        if saved != value:
            where, saved, value = _first_difference(key, saved, value)
            raise InputError(f"{what} checkpoint {where} {_short(saved)} does not match this "
                             f"run's {_short(value)}; {advice}")


def _first_difference(key: str, saved: object, value: object) -> tuple[str, object, object]:
    """The path (``config.sync_every``) and values of the first difference of two values,
    looking inside dicts with the same keys."""
    while isinstance(saved, dict) and isinstance(value, dict) and set(saved) == set(value):
        inner = next(k for k in value if saved[k] != value[k])
        key, saved, value = f"{key}.{inner}", saved[inner], value[inner]
    return key, saved, value


def _short(value: object, limit: int = 300) -> str:
    """``repr(value)``, cut to ``limit`` characters (a layout can name every parameter)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def raise_if_any(problems: list[str | None], rank: int, what: str,
                 error: type[InputError] = InputError) -> None:
    """Raise ``error`` if any rank has a problem (``problems``: every rank's, gathered):
    the first rank's, naming the others that ``what``. Every rank raises the same."""
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if bad:
        first = min(bad)
        others = f" (ranks {sorted(bad)} {what})" if len(bad) > 1 else ""
        raise error(f"{bad[first]}" + ("" if first == rank else f" [reported by rank {first}]")
                    + others)


def few(names: list[str], limit: int = 3) -> str:
    """The first ``limit`` of ``names``, comma-separated, "…" when there are more."""
    return ", ".join(names[:limit]) + (", …" if len(names) > limit else "")
