"""The convergence guard: each bucket's gradient error watched during training, and the
bucket promoted to more bits before the loss suffers.

A front-end holds one :class:`GradGuard` over its buckets when the policy has a
:class:`~commpress.policy.Guard`. Every ``every`` steps (the sampled steps) each bucket's
gradient collective runs inside the bucket's :class:`~commpress.Watch`, which sums the
error of what its codes send where the data already is (no extra communication, no host
sync per call). After the step's reductions :meth:`GradGuard.decide` gathers every rank's
sums — one small gather per sampled step — and adds them in rank order, so every rank
reads the same relative error ``‖v − v̂‖ / ‖v‖`` per bucket and takes the same decision:

- over ``max_rel_error`` in ``window`` sampled steps in a row: the bucket's lossy
  ``dp.grad`` rules go one rung up (:func:`~commpress.policy.promote_codec`: int2 → int4
  → int8 → exact), a fresh gradient path (its error-feedback memory restarts with the new
  codec);
- codes that decoded non-finite where the input was finite: promoted at once. Input that
  was non-finite already stays so and decides nothing.

Each promotion is logged once (rank 0) with the bucket, the signal and the new codec,
kept in :attr:`GradGuard.events` (the trainer's report marks them on the loss curve) and
in the state dict, so a resume holds the same codecs. Buckets are not demoted after a
quiet window: a codec that failed its budget once on this model's gradients would be
tried again on the same kind of data, and each switch restarts its memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from contextlib import nullcontext
from typing import Any

import torch.distributed as dist

from commpress.collectives.agreement import all_gather_objects
from commpress.collectives.watch import Watch
from commpress.dp.bucket import DPBucket
from commpress.policy import Guard, Policy, Rule
from commpress.validate import InputError

log = logging.getLogger(__name__)
STATE_FORMAT = "commpress.guard/1"


class GradGuard:
    """The guard of ``buckets`` (each a :class:`DPBucket`) under ``guard``; ``what``
    names the front-end in its log lines."""

    def __init__(self, guard: Guard, buckets: list[DPBucket], what: str) -> None:
        self.guard, self.buckets, self.what = guard, buckets, what
        self.base = [b.policy for b in buckets]
        self.layout = [b.alignment for b in buckets]  # what each bucket's buffers fit
        self.watches = [Watch() for _ in buckets]
        self.over = [0] * len(buckets)  # sampled steps in a row over the budget
        self.signals: list[float] = []  # the last sampled step's relative error per bucket
        self.events: list[dict[str, Any]] = []
        self._unreported: dict[str, Any] | None = None  # for the trainer's step record

    def sampling(self, step: int) -> bool:
        """Whether step ``step`` (0-based, every rank alike) is sampled."""
        return step % self.guard.every == 0

    def watching(self, j: int, step: int) -> Any:
        """The context bucket ``j``'s gradient collective of step ``step`` runs in."""
        return self.watches[j].watching() if self.sampling(step) else nullcontext()

    def decide(self, step: int, group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
        """After a sampled step's reductions: every rank's sums added in rank order, the
        signal per bucket, and the promotions it calls for (taken here, on every rank
        alike); returns them."""
        mine = [w.sums()[:2].tolist() for w in self.watches]  # the one host sync
        for w in self.watches:
            w.reset()
        ranks = (all_gather_objects(mine, group, f"{self.what} guard signals")
                 if group is not None and dist.is_initialized() and group.size() > 1
                 else [mine])
        taken = []
        self.signals = []
        for j in range(len(self.buckets)):
            err2 = sum(r[j][0] for r in ranks)
            norm2 = sum(r[j][1] for r in ranks)
            signal = _relative(err2, norm2)
            self.signals.append(signal)
            if not math.isfinite(norm2):  # the input was non-finite: nothing to decide
                self.over[j] = 0
                continue
            broken = not math.isfinite(err2)
            self.over[j] = self.over[j] + 1 if broken or signal > self.guard.max_rel_error else 0
            if broken or self.over[j] >= self.guard.window:
                event = self._promote(j, step, signal, broken)
                if event is not None:
                    taken.append(event)
        self._unreported = {"step": step, "rel_error": list(self.signals), "promoted": taken}
        return taken

    def take_record(self) -> dict[str, Any] | None:
        """The last sampled step's signals and promotions, once (None since)."""
        record, self._unreported = self._unreported, None
        return record

    def _promote(self, j: int, step: int, signal: float, broken: bool) -> dict[str, Any] | None:
        b = self.buckets[j]
        keys = lossy_grad_keys(b.policy)
        self.over[j] = 0
        if not keys:
            return None  # exact already
        before = describe(b, keys)
        b.promote_grad(self._next(j, b.policy))
        event = {"step": step, "bucket": j, "rel_error": signal, "from": before,
                 "to": describe(b, keys), "reason": "non-finite codes" if broken else
                 f"over {self.guard.max_rel_error:g} in {self.guard.window} samples"}
        self.events.append(event)
        if _rank() == 0:
            log.warning("%s guard: bucket %d at step %d, relative error %.4g (%s): %s → %s",
                        self.what, j, step, signal, event["reason"], before, event["to"])
        return event

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "over": list(self.over),
                "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take the saved promotions — each event is one rung of its bucket — before the
        buckets' codec states are loaded (their layout follows the codec), and the
        counters; None: a state saved without the guard, every bucket as the policy has
        it."""
        if state is None:
            state = {"format": STATE_FORMAT, "over": [0] * len(self.buckets), "events": []}
        n = len(self.buckets)
        ok = (isinstance(state, dict) and state.get("format") == STATE_FORMAT
              and isinstance(state.get("over"), list) and len(state["over"]) == n
              and isinstance(state.get("events"), list)
              and all(isinstance(e, dict) and e.get("bucket") in range(n)
                      for e in state["events"]))
        if not ok:
            raise InputError(f"{self.what}: the saved guard state {_short(state)} is not "
                             f"allowed; allowed: {STATE_FORMAT!r} for {len(self.buckets)} "
                             "buckets, from this front-end's state_dict()")
        self.events = [dict(e) for e in state["events"]]
        for j, (b, base) in enumerate(zip(self.buckets, self.base)):
            policy = base
            for _ in range(sum(e["bucket"] == j for e in self.events)):
                policy = self._next(j, policy)
            if policy != b.policy:
                b.promote_grad(policy)
        self.over = [int(x) for x in state["over"]]

    def _next(self, j: int, policy: Policy) -> Policy:
        """Bucket ``j``'s policy one rung up: its lossy ``dp.grad`` rules promoted, or
        exact where the next codec's alignment does not fit the bucket's buffers."""
        keys = lossy_grad_keys(policy)
        up = policy.promoted(keys)
        if self.layout[j] % self.buckets[j].grad_alignment_under(up):
            up = dataclasses.replace(up, rules={**up.rules, **{k: Rule() for k in keys}})
        return up


def lossy_grad_keys(policy: Policy) -> tuple[str, ...]:
    """The policy's ``dp.grad`` rules that send lossy codes."""
    return tuple(k for k, r in sorted(policy.rules.items())
                 if k.startswith("dp.grad") and r.lossy)


def describe(b: DPBucket, keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={b.policy.rules[k].codec}"
                     + ("+ef" if b.policy.rules[k].error_feedback else "") for k in keys)


def _relative(err2: float, norm2: float) -> float:
    """``sqrt(err2 / norm2)``: 0 for nothing lossy sent, NaN for non-finite input."""
    if norm2 == 0:
        return 0.0 if err2 == 0 else math.inf
    return math.sqrt(err2 / norm2)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _short(state: Any) -> str:
    text = repr(state)
    return text if len(text) < 80 else text[:77] + "..."
