"""Hugging Face ``transformers.Trainer``: the commpress DDP hook in one line.

The Trainer builds its own accelerator and wraps the model in DDP inside ``train()``, so
there is no model to register a hook on beforehand, and accelerate's ``comm_hook`` option
takes only torch's own hooks. :func:`compress` adds a callback that registers
:func:`commpress.ddp_hook` (or :func:`commpress.lowrank_hook`) on the DDP module when
training begins, and keeps each rank's codec state in the Trainer's own checkpoints::

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    commpress.transformers.compress(trainer, "int2ef")
    trainer.train()                      # or train(resume_from_checkpoint=True)

Each ``checkpoint-<step>/`` gets ``commpress-rank<r>.pt`` per rank (verified files,
:mod:`commpress.engines.rank_state`): error-feedback memory and rounding counters
are each rank's own. Resuming from a checkpoint without them, or with another rank's or
world's, is refused on every rank naming the file and the way on: ``compress(trainer,
..., elastic=True)`` resumes a checkpoint of another number of ranks, or of a run saved
without commpress, its codecs starting fresh. Gradient accumulation (the Trainer's
``no_sync`` micro-steps), ``ddp_find_unused_parameters`` and ``max_grad_norm`` work as with
DDP's own all-reduce. DeepSpeed and FSDP in the Trainer are refused (their adapters are
``commpress.deepspeed`` and ``commpress.fsdp``); one process has nothing to compress and
is left alone, said once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from commpress.collectives import Topology
from commpress.engines import rank_state
from commpress.engines.seam import Swap, install, restore
from commpress.frontends.ddp import BUCKET_NUMEL, ddp_hook
from commpress.frontends.ddp_lowrank import lowrank_hook
from commpress.policy import Policy
from commpress.validate import InputError, check_bool

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as e:  # pragma: no cover - the engine tests require it
    raise ImportError("commpress.transformers needs transformers: pip install -r "
                      "requirements-engines.txt (transformers==5.24.0)") from e

log = logging.getLogger(__name__)
WHAT = "commpress.transformers"


class Compression(TrainerCallback):
    """The callback :func:`compress` adds, and its handle: :meth:`state_dict` /
    :meth:`load_state_dict` (the hook's codec state, which the Trainer's checkpoints
    carry by themselves) and :meth:`remove`."""

    def __init__(self, trainer: Trainer, policy: str | dict | Policy, lowrank: dict | None,
                 topology: Topology | None, overlap: bool, bucket_numel: int,
                 elastic: bool) -> None:
        self.trainer = trainer
        self.policy, self.lowrank = policy, lowrank
        self.topology, self.overlap, self.bucket_numel = topology, overlap, bucket_numel
        self.elastic = elastic
        self.hook_state: Any = None
        self._ddp: DistributedDataParallel | None = None
        self._resume: str | None = None  # the checkpoint ``train()`` resumes from
        self._loaded: dict | None = None  # load_state_dict before the hook exists
        original = trainer.train

        @functools.wraps(original)
        def train(resume_from_checkpoint: str | bool | None = None, *args: Any,
                  **kwargs: Any) -> Any:
            self._resume = _checkpoint_dir(trainer, resume_from_checkpoint)
            return original(resume_from_checkpoint, *args, **kwargs)

        # the one way an adapter changes an engine's object (engines/seam.py)
        self._swaps = install([Swap(trainer, "train", train)])

    # -- the Trainer's events --------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            if args.world_size > 1:
                raise InputError(f"{WHAT}: the Trainer trains {type(ddp).__name__}, not "
                                 "DistributedDataParallel; allowed: the Trainer's DDP (several "
                                 "processes, no DeepSpeed or FSDP)")
            log.warning("%s: one process, no DDP: nothing to compress", WHAT)
            return
        if ddp is not self._ddp:  # a second train() keeps the DDP module and its hook
            self.hook_state, hook = self._hook(ddp)
            ddp.register_comm_hook(self.hook_state, hook)
            self._ddp = ddp
            if self._loaded is not None:
                self.hook_state.load_state_dict(self._loaded, self.elastic)
                self._loaded = None
        if self._resume is not None:
            missing = f"save the checkpoint with {WHAT}.compress(trainer, ...) applied"
            saved = rank_state.resume_from(self._resume, WHAT, missing, self.elastic,
                                           f"{WHAT}.compress(trainer, ..., elastic=True)")
            if saved is not None:
                self.hook_state.load_state_dict(saved, self.elastic)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook_state is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)  # rank 0 may not have made it yet
        rank_state.save_in(self.hook_state.state_dict(), folder, WHAT)

    # -- the handle ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (what each checkpoint folder's
        ``commpress-rank<r>.pt`` holds); only once training has registered the hook."""
        if self.hook_state is None:
            raise InputError(f"{WHAT}: state_dict() before training began is not allowed: "
                             "the hook, and its state, exist from trainer.train() on")
        return self.hook_state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked as a checkpoint's is; ``elastic`` as given
        to :func:`compress`); before training, kept for the hook ``train()`` registers."""
        if self.hook_state is None:
            self._loaded = state
        else:
            self.hook_state.load_state_dict(state, self.elastic)

    def remove(self) -> None:
        """Undo :func:`compress`: the Trainer's own ``train`` and callbacks again. After
        training began, the hook's thread and process group end too; torch cannot
        unregister a communication hook, so training this Trainer's DDP module again is
        refused by the hook by name (a new Trainer trains without commpress)."""
        if self.hook_state is not None:
            self.hook_state.remove()
        restore(self._swaps)
        self._swaps = []
        self.trainer.remove_callback(self)

    def _hook(self, ddp: DistributedDataParallel) -> tuple[Any, Any]:
        if self.lowrank is not None:
            return lowrank_hook(ddp, **self.lowrank, topology=self.topology,
                                overlap=self.overlap, bucket_numel=self.bucket_numel)
        return ddp_hook(ddp, self.policy, topology=self.topology, overlap=self.overlap,
                        bucket_numel=self.bucket_numel)


def compress(trainer: Trainer, policy: str | dict | Policy = "int4:hadamard=128", *,
             lowrank: dict | None = None, topology: Topology | None = None,
             overlap: bool = True, bucket_numel: int = BUCKET_NUMEL,
             elastic: bool = False) -> Compression:
    """Train ``trainer`` with commpress's DDP hook for ``policy`` (preset, policy file or
    dict, or a codec spec), or with ``lowrank={"rank": 4, ...}`` the low-rank hook (its
    :func:`~commpress.lowrank_hook` arguments). Call it before ``trainer.train()``.
    ``elastic=True`` lets ``train(resume_from_checkpoint=...)`` resume a checkpoint saved
    on another number of ranks, the codecs starting fresh (said once); without it such a
    checkpoint is refused by name. ``elastic=True`` also adds compression to a run whose
    checkpoints were saved without it (they hold no commpress state: the codecs start
    fresh, said once)."""
    if not isinstance(trainer, Trainer):
        raise InputError(f"{WHAT}: trainer must be a transformers.Trainer; got "
                         f"{type(trainer).__name__}")
    for flag, adapter in (("is_deepspeed_enabled", "commpress.deepspeed"),
                          ("is_fsdp_enabled", "commpress.fsdp")):
        if getattr(trainer, flag, False):
            raise InputError(f"{WHAT}: the Trainer runs {flag.split('_')[1]}; allowed: the "
                             f"Trainer's DDP here ({adapter} for that engine)")
    if lowrank is not None and not isinstance(lowrank, dict):
        raise InputError(f"{WHAT}: lowrank={lowrank!r} is not allowed; allowed: a dict of "
                         "lowrank_hook arguments, e.g. {'rank': 4}")
    if any(isinstance(c, Compression) for c in trainer.callback_handler.callbacks):
        raise InputError(f"{WHAT}: this Trainer is compressed already; remove() the first "
                         "one before compressing it again")
    check_bool(f"{WHAT}: elastic", elastic)
    compression = Compression(trainer, policy, lowrank, topology, overlap, bucket_numel,
                              elastic)
    trainer.add_callback(compression)
    return compression


def _checkpoint_dir(trainer: Trainer, resume: str | bool | None) -> str | None:
    """The folder ``Trainer.train(resume_from_checkpoint=resume)`` resumes from, as it
    resolves it (True: the last checkpoint in ``output_dir``)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return get_last_checkpoint(trainer.args.output_dir)
    return os.fspath(resume)
