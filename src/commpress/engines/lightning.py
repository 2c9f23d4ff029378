"""Lightning (and accelerate): the commpress DDP hook on any device.

Lightning's ``DDPStrategy`` registers a communication hook only when its root device
is CUDA, so ``DDPStrategy(ddp_comm_hook=...)`` on CPU is silently ignored and the
gradients go through DDP's own all-reduce. :class:`CommpressDDPStrategy` registers
:func:`commpress.ddp_hook` on every device, keeps the hook's codec state
(error-feedback residuals, stochastic-rounding counters) in the trainer's checkpoints
— one verified file per rank beside the checkpoint, ``<checkpoint>.commpress-rank<r>.pt``
(:mod:`commpress.engines.rank_state`), since each rank's residuals are its own — and
is otherwise Lightning's ``DDPStrategy``.

accelerate needs no adapter: register the hook on the model ``accelerator.prepare``
returns (a ``DistributedDataParallel`` when there are several processes)::

    model, optimizer = accelerator.prepare(model, optimizer)
    model.register_comm_hook(*commpress.ddp_hook(model, "int2ef"))
"""

from __future__ import annotations

import logging
import os
from typing import Any

from commpress.collectives import Topology
from commpress.engines import rank_state
from commpress.frontends.ddp import BUCKET_NUMEL, DDPHookState, ddp_hook
from commpress.policy import Guard, Policy
from commpress.validate import InputError, check_bool

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - the engine tests require it
    raise ImportError("commpress.lightning needs Lightning: pip install -r "
                      "requirements-engines.txt (lightning==2.6.6)") from e

log = logging.getLogger(__name__)
WHAT = "CommpressDDPStrategy"  # names this adapter in messages


class CommpressDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with the commpress gradient hook, on any device.

    Args:
        policy: preset name, policy file, dict or :class:`~commpress.Policy` (or a codec
            spec for ``dp.grad``, as :func:`commpress.ddp_hook` takes).
        topology: node layout for two-level policies (default from ``LOCAL_WORLD_SIZE``).
        overlap: run the hook's collectives on a communication thread during backward.
        bucket_numel: elements per hook bucket.
        elastic: let a checkpoint saved on another number of ranks resume: the codecs then
            start fresh, said once (without it such a checkpoint is refused by name).
        guard: the hook's convergence guard (as :func:`commpress.ddp_hook` takes it): its
            promotions are in ``hook_state.guard.events`` and the checkpoint.
        **kwargs: passed to ``DDPStrategy`` (``find_unused_parameters``, timeout, …).

    Example::

        trainer = L.Trainer(accelerator="cpu", devices=2,
                            strategy=commpress.lightning.CommpressDDPStrategy("int2ef"))
    """

    strategy_name = "commpress_ddp"

    def __init__(self, policy: str | dict | Policy = "none", *,
                 topology: Topology | None = None, overlap: bool = True,
                 bucket_numel: int = BUCKET_NUMEL, elastic: bool = False,
                 guard: Guard | dict | float | None = None, **kwargs: Any) -> None:
        for taken in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(taken) is not None:
                raise InputError(f"CommpressDDPStrategy: {taken} is not allowed: the strategy "
                                 "registers commpress's hook; choose its codecs with policy")
        check_bool("CommpressDDPStrategy: elastic", elastic)
        super().__init__(**kwargs)
        self.policy = policy
        self.elastic = elastic
        self.topology = topology
        self.overlap = overlap
        self.bucket_numel = bucket_numel
        self.guard = guard
        self.hook_state: DDPHookState | None = None
        self._loaded_hook_state: dict | None = None  # from a checkpoint read before setup
        self._failed = False  # the current fit raised

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy's own registers a hook on CUDA only; this one on any device
        self.hook_state, hook = ddp_hook(self.model, self.policy, topology=self.topology,
                                         overlap=self.overlap, bucket_numel=self.bucket_numel,
                                         guard=self.guard)
        if self._loaded_hook_state is not None:
            self.hook_state.load_state_dict(self._loaded_hook_state, self.elastic)
            self._loaded_hook_state = None
        self.model.register_comm_hook(self.hook_state, hook)
        log.info("Applied commpress's DDP hook: policy %s on %s",
                 self.hook_state.policy.name, self.root_device)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # the teardown that follows must not wait for the others
        super().on_exception(exception)

    def teardown(self) -> None:
        # the hook's communication thread and process group end with the fit (a process
        # that fits again, or fits several models, would keep each one's); its codec
        # state stays readable for a checkpoint saved after the fit. After a failure the
        # group is destroyed without waiting: a peer may be dead, and Lightning re-raises
        # the fit's own error only if the teardown raises none
        self.remove()
        super().teardown()

    # -- the handle every adapter offers ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (what ``<checkpoint>.commpress-rank<r>.pt`` holds); once
        the fit has registered the hook."""
        if self.hook_state is None:
            raise InputError(f"{WHAT}: state_dict() before the fit is not allowed: the hook, "
                             "and its state, exist from trainer.fit() on")
        return self.hook_state.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (``elastic`` as given to the strategy); before the
        fit, kept for the hook it registers. ``None``: the codecs start fresh."""
        if state is not None and self.hook_state is not None:
            self.hook_state.load_state_dict(state, self.elastic)
        else:
            self._loaded_hook_state = state

    def remove(self) -> None:
        """End the hook's thread and process group (the fit's teardown does it). A fit
        after it registers a new hook."""
        if self.hook_state is not None:
            self.hook_state.remove(drain=not self._failed)
        self._failed = False

    # -- checkpoints: each rank's codec state beside the checkpoint ---------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if self.hook_state is not None:
            rank_state.save_in(self.hook_state.state_dict(), filepath, WHAT, beside=True)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike,
                        weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = rank_state.resume_from(checkpoint_path, WHAT, "save it with this strategy",
                                       self.elastic, f"{WHAT}(..., elastic=True)",
                                       beside=True)
        self.load_state_dict(state)  # None: elastic, nothing saved: the codecs start fresh
        return checkpoint
