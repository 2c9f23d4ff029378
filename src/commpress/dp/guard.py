"""The convergence guard: each bucket's gradient error watched during training, and the
bucket promoted to more bits before the loss suffers.

A front-end holds one :class:`GradGuard` over its buckets when the policy has a
:class:`~commpress.policy.Guard`: the sharded optimizer's buckets, the DDP hook's, DiLoCo's
fragments. On a sampled step each bucket's collective runs inside the bucket's
:class:`~commpress.Watch`, which sums the error of what its codes send where the data
already is (no extra communication, no host sync per call). After the step's reductions
:meth:`GradGuard.decide` gathers every rank's sums — one small gather per sampled step —
and adds them in rank order, so every rank reads the same signals per bucket and takes
the same decision:

- the relative error ``‖v − v̂‖ / ‖v‖`` of what is sent without error feedback (lost)
  over ``max_rel_error``, or an error-feedback memory ``‖e‖ / ‖x‖`` over
  ``max_memory_ratio`` (delayed, but no longer catching up), in ``window`` sampled steps
  in a row: the bucket's lossy rules go one rung up (:func:`~commpress.policy.promote_codec`:
  int2 → int4 → int8 → exact), a fresh path (its memory restarts with the new codec);
- codes that decoded non-finite where the input was finite: promoted at once. Input that
  was non-finite already stays so and decides nothing.

Steps are sampled every step until a bucket has ``window`` samples under its present
codec — so the first decision comes ``window`` steps into the run, and a promoted bucket
is judged again as soon — then every ``every`` steps.

Each promotion is logged once (rank 0) with the bucket, the signals and the new codec,
kept in :attr:`GradGuard.events` (the trainer's report marks them on the loss curve) and
in the state dict, so a resume holds the same codecs. Buckets are not demoted after a
quiet window: a codec that failed its budget once on this model's gradients would be
tried again on the same kind of data, and each switch restarts its memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.collectives.watch import SUMS, Watch, ratio, signals
from commpress.dp.bucket import DPBucket
from commpress.policy import Guard, Policy, Rule
from commpress.validate import InputError

log = logging.getLogger(__name__)
STATE_FORMAT = "commpress.guard/2"
FORMER_FORMAT = "commpress.guard/1"  # no sampling counts: read as sampled enough


class GradGuard:
    """The guard of ``buckets`` (each a :class:`DPBucket`) under ``guard``, over their
    ``kind`` rules (``"dp.grad"``; DiLoCo's fragments: ``"outer.grad"``) and, with
    ``weights`` (the front-end measures its gathered weights: :meth:`decide`), their
    ``dp.param`` rules; ``what`` names the front-end in its log lines. ``aligned``: each
    bucket's buffers are laid out for its alignment, so a rung that does not fit it goes
    to exact (a fragment's all-reduce pads its own: False)."""

    def __init__(self, guard: Guard, buckets: list[DPBucket], what: str,
                 kind: str = "dp.grad", aligned: bool = True, weights: bool = False) -> None:
        self.guard, self.buckets, self.what = guard, buckets, what
        self.kinds = (kind, "dp.param") if weights else (kind,)
        self.base = [b.policy for b in buckets]
        self.layout = [b.alignment if aligned else None for b in buckets]
        self.watches = [Watch() for _ in buckets]
        # per kind, sampled steps in a row over the budget
        self.over = {k: [0] * len(buckets) for k in self.kinds}
        self.since = [0] * len(buckets)  # samples under the bucket's present codec
        self.signals: list[dict[str, float]] = []  # the last decision's, per bucket
        self.events: list[dict[str, Any]] = []
        self._unreported: list[dict[str, Any]] = []  # for the trainer's step records
        self._lock = threading.Lock()
        self._find_lossy()

    def sampling(self, step: int, only: list[int] | None = None) -> bool:
        """Whether step ``step`` (0-based, every rank alike) is sampled, for the buckets
        ``only`` (default: all, decided together): every step while one of them has fewer
        than ``window`` samples under its codec — the first decision comes at step
        ``window - 1``, and a promoted bucket is judged again as soon — else every
        ``every`` steps; never when all of them are exact."""
        lossy = [j for j in self._indices(only) if self._lossy[j]]
        if not lossy:
            return False  # exact everywhere: nothing to judge, nothing to gather
        return any(self.since[j] < self.guard.window for j in lossy) or (
            step % self.guard.every == 0)

    def watching(self, j: int, sampled: bool) -> Any:
        """The context bucket ``j``'s collective runs in: its watch on a sampled step."""
        return self.watches[j].watching() if sampled else nullcontext()

    def decide(self, step: int, group: dist.ProcessGroup | None,
               only: list[int] | None = None,
               weights: list[torch.Tensor] | None = None) -> list[dict[str, Any]]:
        """After a sampled step's reductions of the buckets ``only`` (default: all): every
        rank's sums added in rank order, the signals per bucket, and the promotions they
        call for (taken here, on every rank alike); returns them. ``weights``: per bucket,
        this rank's ``[‖w − m‖², ‖m‖²]`` of the weights its last gather gave (``w``) and
        the master weights they stand for (``m``): the ``weight_gap`` its ``dp.param``
        rules are judged by."""
        indices = self._indices(only)
        rows = [self.watches[j].sums() for j in indices]
        if weights is not None:
            rows = [torch.cat([r, w.to(r.device, r.dtype)])
                    for r, w in zip(rows, weights, strict=True)]
        # a watch that saw no lossy encode holds zeros on the CPU: one device for the stack
        device = next((r.device for r in rows if r.device.type != "cpu"), torch.device("cpu"))
        mine = torch.stack([r.to(device) for r in rows]).tolist()  # the one host sync
        for j in indices:
            self.watches[j].reset()
        ranks = (all_gather_objects(mine, group, f"{self.what} guard signals")
                 if group is not None and dist.is_initialized() and group.size() > 1
                 else [mine])
        taken = []
        self.signals = []
        g = self.guard
        for i, j in enumerate(indices):
            sums = [sum(r[i][k] for r in ranks) for k in range(len(SUMS))]
            signal = signals(sums)
            if weights is not None:
                gap2, master2 = (sum(r[i][k] for r in ranks) for k in (-2, -1))
                signal["weight_gap"] = ratio(gap2, master2)
            self.signals.append(signal)
            self.since[j] += 1
            # per kind: (over budget now, codes non-finite from finite values) — None where
            # the values were non-finite already, which decides nothing
            judged: dict[str, tuple[bool, bool] | None] = {}
            plain_err2, plain2, ef_err2, ef2, memory2, given2 = sums
            # error feedback sends input + a memory kept finite: what it sent is non-finite
            # only where its codes decoded so (ef2 then is too), from finite input
            if all(map(math.isfinite, (plain2, given2))):
                broken = not all(map(math.isfinite, (plain_err2, ef_err2, ef2, memory2)))
                judged[self.kinds[0]] = (signal["plain_rel_error"] > g.max_rel_error
                                         or signal["memory_ratio"] > g.max_memory_ratio, broken)
            else:
                judged[self.kinds[0]] = None
            if weights is not None:
                judged["dp.param"] = (None if not math.isfinite(master2) else
                                      (signal["weight_gap"] > g.max_weight_gap,
                                       not math.isfinite(gap2)))
            for kind, verdict in judged.items():
                over, broken = verdict if verdict is not None else (False, False)
                self.over[kind][j] = self.over[kind][j] + 1 if over or broken else 0
                if broken or self.over[kind][j] >= g.window:
                    event = self._promote(j, kind, step, signal, broken)
                    if event is not None:
                        taken.append(event)
        record = {"step": step, "what": self.what, "buckets": indices,
                  "rel_error": [s["plain_rel_error"] for s in self.signals],
                  "memory_ratio": [s["memory_ratio"] for s in self.signals],
                  **({"weight_gap": [s["weight_gap"] for s in self.signals]}
                     if weights is not None else {}), "promoted": taken}
        with self._lock:  # DiLoCo decides on its communication thread
            self._unreported.append(record)
        return taken

    def take_records(self) -> list[dict[str, Any]]:
        """The sampled steps' signals and promotions since the last call, once."""
        with self._lock:
            records, self._unreported = self._unreported, []
        return records

    def restart(self, indices: list[int]) -> None:
        """Buckets ``indices`` hold other values from now on (DiLoCo re-formed those
        fragments): their counts start again."""
        for j in indices:
            self.since[j] = 0
            for counts in self.over.values():
                counts[j] = 0

    def _indices(self, only: list[int] | None) -> list[int]:
        return list(range(len(self.buckets))) if only is None else list(only)

    def _find_lossy(self) -> None:
        """Which buckets send lossy codes (asked per bucket call; changed by promotions)."""
        self._lossy = [any(lossy_keys(b.policy, k) for k in self.kinds) for b in self.buckets]

    def _promote(self, j: int, kind: str, step: int, signal: dict[str, float],
                 broken: bool) -> dict[str, Any] | None:
        b = self.buckets[j]
        keys = lossy_keys(b.policy, kind)
        self.over[kind][j] = 0
        if not keys:
            return None  # exact already
        before = describe(b, keys)
        _apply(b, kind, self._next(j, b.policy, kind))
        self._find_lossy()
        self.since[j] = 0
        g = self.guard
        budget = (f"over weight_gap {g.max_weight_gap:g}" if kind == "dp.param" else
                  f"over rel_error {g.max_rel_error:g} / memory_ratio {g.max_memory_ratio:g}")
        event = {"step": step, "bucket": j, "kind": kind, **signal, "from": before,
                 "to": describe(b, keys), "reason": "non-finite codes" if broken else
                 f"{budget} in {g.window} samples"}
        event["rel_error"] = event.pop("plain_rel_error")
        self.events.append(event)
        if _rank() == 0:
            log.warning("%s guard: bucket %d at step %d, %s (%s): %s → %s", self.what, j,
                        step, ", ".join(f"{k} {v:.4g}" for k, v in signal.items()
                                        if k != "rel_error"), event["reason"], before,
                        event["to"])
        return event

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "over": {k: list(v) for k, v in self.over.items()},
                "since": list(self.since), "events": [dict(e) for e in self.events]}

    def check_state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """A saved guard state as :meth:`load_state_dict` takes it, or an
        :class:`InputError` naming it (run inside the front-end's agreed resume check, so
        that every rank refuses together)."""
        n = len(self.buckets)
        if state is None:
            state = {"format": STATE_FORMAT, "over": {k: [0] * n for k in self.kinds},
                     "since": [0] * n, "events": []}
        if isinstance(state, dict) and state.get("format") == FORMER_FORMAT:
            state = {**state, "format": STATE_FORMAT, "since": [self.guard.window] * n,
                     "over": {**{k: [0] * n for k in self.kinds},
                              self.kinds[0]: state.get("over")}}
        ok = (isinstance(state, dict) and state.get("format") == STATE_FORMAT
              and isinstance(state.get("over"), dict) and set(state["over"]) == set(self.kinds)
              and all(_counts(c, n) for c in [state.get("since"), *state["over"].values()])
              and isinstance(state.get("events"), list)
              and all(isinstance(e, dict) and e.get("bucket") in range(n)
                      and e.get("kind", self.kinds[0]) in self.kinds
                      for e in state["events"]))
        if not ok:
            raise InputError(f"{self.what}: the saved guard state {_short(state)} is not "
                             f"allowed; allowed: {STATE_FORMAT!r} for {n} buckets, from "
                             "this front-end's state_dict()")
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take the saved promotions — each event is one rung of its bucket — before the
        buckets' codec states are loaded (their layout follows the codec), and the
        counters; None: a state saved without the guard, every bucket as the policy has
        it. A state of the first format (no ``since``) takes every bucket as sampled
        enough."""
        state = self.check_state(state)
        self.events = [{"kind": self.kinds[0], **e} for e in state["events"]]
        for j, (b, base) in enumerate(zip(self.buckets, self.base)):
            policy = base
            for e in self.events:  # in the order they were taken
                if e["bucket"] == j:
                    policy = self._next(j, policy, e["kind"])
            if policy != b.policy:
                for kind in self.kinds:
                    _apply(b, kind, policy)
        self._find_lossy()
        self.over = {k: list(v) for k, v in state["over"].items()}
        self.since = list(state["since"])

    def _next(self, j: int, policy: Policy, kind: str) -> Policy:
        """Bucket ``j``'s policy with its lossy ``kind`` rules one rung up, or exact where
        the next codec's alignment does not fit the bucket's buffers."""
        keys = lossy_keys(policy, kind)
        up = policy.promoted(keys)
        layout = self.layout[j]
        if layout is not None and layout % self.buckets[j].alignment_under(up):
            up = dataclasses.replace(up, rules={**up.rules, **{k: Rule() for k in keys}})
        return up


def _apply(b: DPBucket, kind: str, policy: Policy) -> None:
    """``b`` under ``policy`` from now on, for its ``kind`` rules only."""
    if kind == "dp.param":
        b.promote_param(policy)
    else:
        b.promote_grad(policy)


def _counts(value: Any, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(x, int) and x >= 0 for x in value))


def lossy_keys(policy: Policy, kind: str = "dp.grad") -> tuple[str, ...]:
    """The policy's ``kind`` rules (``dp.grad``, ``dp.grad.inter``, …) that send lossy
    codes."""
    return tuple(k for k, r in sorted(policy.rules.items())
                 if (k == kind or k.startswith(kind + ".")) and r.lossy)


def describe(b: DPBucket, keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={b.policy.rules[k].codec}"
                     + ("+ef" if b.policy.rules[k].error_feedback else "") for k in keys)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _short(state: Any) -> str:
    text = repr(state)
    return text if len(text) < 80 else text[:77] + "..."
