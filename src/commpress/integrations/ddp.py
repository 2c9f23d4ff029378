"""A DDP communication hook: compressed gradient all-reduce per bucket.

``model.register_comm_hook(*commpress.ddp_hook("hybrid"))`` replaces DDP's all-reduce
with the policy's ``dp.grad`` codec: one-level :func:`commpress.all_reduce`, or — when
the policy names ``intra``/``inter`` codecs and the topology has several nodes —
:func:`commpress.hierarchical_all_reduce`: reduce-scatter inside the node with the
``intra`` codec, all-reduce of the node sums across nodes with the ``inter`` codec,
exact all-gather inside the node. Every rank decodes the same bytes, so replicas stay
identical.

With ``overlap=True`` (default) the compressed all-reduce of each bucket runs on one
communication thread, in the order DDP hands buckets over (the same on every rank), so
backward keeps computing while a bucket is encoded and sent, and the next bucket is
encoded while the previous one is on the wire; DDP waits for the returned futures
before the optimizer step. Blocking collectives release the GIL.

Unlike PyTorch's PowerSGD state, :class:`DDPHookState` checkpoints: codec states
(error-feedback residuals, stochastic-rounding counters) are keyed by bucket index and
size.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives import all_reduce, hierarchical_all_reduce
from commpress.collectives.topology import Topology
from commpress.policy import Policy


class _CommThread:
    """One daemon thread running each bucket's collective in DDP's bucket order.

    A job is split in two: ``start`` (reduce inside the node, encode, start the slow
    transfer) returns ``finish`` (wait, decode, share inside the node). Bucket ``k``
    finishes after bucket ``k + 1`` has started — or at once if it is the last — so
    the slow link carries one bucket while the next is encoded. The schedule depends
    only on the bucket order, which is the same on every rank: all ranks issue their
    collectives in the same order.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="commpress-ddp", daemon=True)
        self._thread.start()

    def submit(self, start: Callable[[], Callable[[], torch.Tensor]],
               last: bool) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((start, last, fut))
        return fut

    @staticmethod
    def _finish(finish: Callable[[], torch.Tensor], fut: torch.futures.Future) -> None:
        try:
            fut.set_result(finish())
        except BaseException as e:  # noqa: BLE001 - delivered to the waiting rank
            fut.set_exception(e)

    def _loop(self) -> None:
        pending = None  # (finish, future) of the previous bucket
        while True:
            start, last, fut = self._queue.get()
            finish = None
            try:
                finish = start()
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting rank
                fut.set_exception(e)
            if pending is not None:
                self._finish(*pending)
                pending = None
            if finish is not None:
                if last:
                    self._finish(finish, fut)
                else:
                    pending = (finish, fut)


class DDPHookState:
    """Hook state: the policy, the group, and one set of codecs per DDP bucket.

    Slots: hyperparameters (``policy``, ``topology``); internal state (``codecs``, by
    bucket index); stats (``calls``). The process group is dropped when pickled.
    """

    def __init__(self, policy: str | dict | Policy = "none",
                 group: dist.ProcessGroup | None = None, topology: Topology | None = None,
                 label: str = "dp.grad", overlap: bool = True) -> None:
        # hyperparameters
        self.policy = Policy.resolve(policy)
        self.topology = topology or Topology()
        self.label = label
        self.group = group
        self.overlap = overlap
        self._thread: _CommThread | None = None
        # internal state: codecs per bucket, keyed "index:numel" — DDP rebuilds its
        # buckets after the first iteration, so an index may change size; the codecs of
        # the old size are then dropped (their error-feedback memory is one iteration's
        # compression error, as large as the bucket: kept, it would pin that memory)
        self.codecs: dict[str, dict[str, Any]] = {}
        self._pending_state: dict[str, dict[str, Any]] = {}
        # stats
        self.calls = 0

    def codecs_for(self, bucket_key: str) -> dict[str, Any]:
        if bucket_key not in self.codecs:
            index = bucket_key.split(":")[0]
            for stale in [k for k in self.codecs if k.split(":")[0] == index]:
                del self.codecs[stale]
            p = self.policy
            if p.two_level():
                codecs = {"intra": p.codec_for("dp", "grad", "intra"),
                          "inter": p.codec_for("dp", "grad", "inter")}
            else:
                codecs = {"single": p.codec_for("dp", "grad")}
            saved = self._pending_state.pop(bucket_key, None)
            if saved:
                for k, c in codecs.items():
                    c.load_state_dict(saved[k])
            self.codecs[bucket_key] = codecs
        return self.codecs[bucket_key]

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "calls": self.calls,
                "codecs": {i: {k: c.state_dict() for k, c in cs.items()}
                           for i, cs in self.codecs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["policy"] != self.policy.to_dict():
            raise ValueError(f"DDP hook checkpoint policy {state['policy']!r} does not match "
                             f"this run's {self.policy.to_dict()!r}")
        self.calls = state["calls"]
        self.codecs = {}
        self._pending_state = dict(state["codecs"])

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["group"] = None
        d["_thread"] = None
        return d

    def run(self, start: Callable[[], Callable[[], torch.Tensor]],
            last: bool) -> torch.futures.Future:
        """Run ``start()`` and the ``finish()`` it returns on the communication thread
        (overlap) or now; a future either way."""
        if self.overlap:
            if self._thread is None:
                self._thread = _CommThread()
            return self._thread.submit(start, last)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(start()())
        return fut


def compressed_allreduce_hook(state: DDPHookState,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over the group with the policy's ``dp.grad`` codecs.

    Sends about ``2 · numel · bits / 8`` bytes per rank (reduce-scatter + all-gather);
    two-level, ``2 · (nodes − 1) / nodes · numel · bits_inter / 8`` per node cross nodes.
    """
    tensor = bucket.buffer()
    group = state.group if state.group is not None else dist.group.WORLD
    codecs = state.codecs_for(f"{bucket.index()}:{tensor.numel()}")
    state.calls += 1

    def start() -> Callable[[], torch.Tensor]:
        if "single" in codecs:
            handle = all_reduce(tensor, codecs["single"], group=group, op="avg",
                                label=state.label, async_op=True)
        else:
            handle = hierarchical_all_reduce(tensor, codecs["intra"], codecs["inter"],
                                             topology=state.topology, group=group, op="avg",
                                             label=state.label, async_op=True)
        return handle.wait

    return state.run(start, bucket.is_last())


def ddp_hook(policy: str | dict | Policy = "none", group: dist.ProcessGroup | None = None,
             topology: Topology | None = None, overlap: bool = True):
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Example::

        model = DDP(model)
        model.register_comm_hook(*commpress.ddp_hook("sdp4bit"))
    """
    return DDPHookState(policy, group, topology, overlap=overlap), compressed_allreduce_hook
