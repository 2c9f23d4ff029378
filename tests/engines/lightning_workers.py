"""Per-rank Lightning and accelerate runs for the engine tests (module level: picklable).

The ranks come from :func:`commpress.launch.spawn` with the process group already
initialized; Lightning sees ``LOCAL_RANK`` and does not launch processes of its own,
accelerate reads the same environment.
"""

import hashlib
import logging
import os
import threading
import warnings

import torch
import torch.distributed as dist

import commpress
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

SEQ, BATCH, LR = 32, 8, 3e-3
INT4 = {"name": "int4", "dp": {"grad": "int4:hadamard=128"}}


def _model():
    torch.manual_seed(0)
    return GPT(config_from_preset("gpt-tiny", block_size=SEQ))


def _rank_batch(data, step, rank, world):
    x, y = data.batch("train", BATCH, SEQ, 0, step)
    per = BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mean(value, world):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return t.item() / world


def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


# -- Lightning --------------------------------------------------------------------------

def _lightning_module(rank, world, steps_seen, killer=None, nan_at=None):
    """``nan_at``: ``(rank, step)`` whose loss is made NaN (one rank's bad batch)."""
    import lightning as L

    data = TextData(load_tokens(max_bytes=200_000))

    class GPTModule(L.LightningModule):
        """gpt-tiny; the batch is picked by the global step, so a resumed fit sees the
        batches an uninterrupted one would."""

        def __init__(self):
            super().__init__()
            self.gpt = _model()

        def training_step(self, batch, batch_idx):
            x, y = _rank_batch(data, self.global_step, rank, world)
            _, loss = self.gpt(x, y)
            if nan_at == (rank, self.global_step):
                loss = loss * float("nan")
            if killer is not None:
                killer.mid_step(self.global_step)
            steps_seen.append(loss.detach())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            steps_seen[-1] = (steps_seen[-1], _hash(self.gpt))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    return GPTModule()


def _trainer(strategy, steps, directory=None):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                     max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, default_root_dir=directory)


def lightning_fit(rank, world, strategy, steps, start=0, ckpt_path=None, save_to=None,
                  nan_at=None):
    """Fit until global step ``start + steps``; per step run here the mean loss and the
    weights' hash (and whether the weights are all finite at the end)."""
    seen = []
    module = _lightning_module(rank, world, seen, nan_at=nan_at)
    trainer = _trainer(strategy, start + steps)
    loader = torch.utils.data.DataLoader(range(1000), batch_size=None)  # batches: by step
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"losses": [_mean(loss, world) for loss, _ in seen], "hashes": [h for _, h in seen],
            "finite": all(bool(p.isfinite().all()) for p in module.gpt.parameters())}


def _same(a, b):
    """Whether two nested states are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


EF = {"name": "ef", "dp": {"grad": {"codec": "int2", "error_feedback": True}}}


def lightning_runs(rank, world, directory, steps):
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from commpress.engines.lightning import CommpressDDPStrategy

    _quiet()
    out = {}
    commpress.reset_stats()
    out["stock"] = lightning_fit(rank, world, DDPStrategy(), steps)
    # Lightning's own strategy drops a hook on CPU without a word
    out["stock fp16 hook"] = lightning_fit(
        rank, world, DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook), steps)
    out["none"] = lightning_fit(rank, world, CommpressDDPStrategy("none"), steps)
    commpress.reset_stats()
    out["int4"] = lightning_fit(rank, world, CommpressDDPStrategy(INT4), steps)
    out["int4"]["stats"] = commpress.stats()
    # save after `steps`, resume for `steps` more: equals 2·steps uninterrupted
    ckpt = os.path.join(directory, "half.ckpt")
    out["ef uninterrupted"] = lightning_fit(rank, world, CommpressDDPStrategy(EF), 2 * steps)
    saver = CommpressDDPStrategy(EF)
    try:
        saver.state_dict()
        out["state before fit"] = None
    except commpress.InputError as e:
        out["state before fit"] = str(e)
    lightning_fit(rank, world, saver, steps, save_to=ckpt)
    # the handle's state is what the checkpoint carries beside it
    from commpress.engines import rank_state
    saved = rank_state.resume_from(ckpt, "test", "", False, "", beside=True)
    out["handle equals file"] = _same(saver.state_dict(), saved)
    dist.barrier()
    out["ef resumed"] = lightning_fit(rank, world, CommpressDDPStrategy(EF), steps, start=steps,
                                      ckpt_path=ckpt)
    # the hook's convergence guard inside Lightning: int2 without Hadamard promoted
    guarded = CommpressDDPStrategy({"name": "naive-int2", "dp": {"grad": "int2:hadamard=0"}},
                                   guard={"max_rel_error": 0.3, "window": 2, "every": 1})
    out["guarded"] = lightning_fit(rank, world, guarded, steps)
    out["guarded"]["events"] = guarded.hook_state.guard.events
    # every fit above ended its hook's thread (and process group) with it
    out["hook threads left"] = sum(t.name == "commpress-ddp" for t in threading.enumerate())
    return out


def lightning_killed_mid_step(rank, world, victim):
    """int4 through ``CommpressDDPStrategy``; the victim SIGKILLs itself after the
    forward pass of step 2."""
    from commpress.engines.lightning import CommpressDDPStrategy
    from tests.reliability.killing import Killer

    _quiet()
    killer = Killer(rank, victim, at_step=2)
    module = _lightning_module(rank, world, [], killer)
    trainer = _trainer(CommpressDDPStrategy(INT4), 1000)
    loader = torch.utils.data.DataLoader(range(1000), batch_size=None)
    return killer.survive(lambda: trainer.fit(module, loader))


def lightning_adversarial(rank, world):
    """Ranks that give the strategy different policies (each rank's error, or None), and
    a NaN loss on the last rank at step 1 under error feedback."""
    from commpress.engines.lightning import CommpressDDPStrategy

    _quiet()
    out = {}
    try:
        lightning_fit(rank, world, CommpressDDPStrategy(INT4 if rank == 0 else EF), 2)
        out["policies"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the error
        out["policies"] = f"{type(e).__name__}: {e}"
    out["nan"] = lightning_fit(rank, world, CommpressDDPStrategy(EF), 3,
                               nan_at=(world - 1, 1))
    return out


# -- accelerate --------------------------------------------------------------------------

def accelerate_train(rank, world, policy, steps, killer=None, save_to=None, load_from=None):
    """The README recipe: prepare, then register the hook on the model prepare returns
    (``killer``: a rank dies mid-step, :class:`tests.reliability.killing.Killer`). With
    ``save_to`` / ``load_from`` the hook state is handed to accelerate's
    ``register_for_checkpointing``, saved after the steps / loaded before them."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if policy is not None:
        state, hook = commpress.ddp_hook(model, policy)
        model.register_comm_hook(state, hook)
        if save_to or load_from:
            accelerator.register_for_checkpointing(state)
    if load_from:
        accelerator.load_state(load_from)
    data = TextData(load_tokens(max_bytes=200_000))
    losses, hashes = [], []
    for step in range(steps):
        x, y = _rank_batch(data, step, rank, world)
        _, loss = model(x, y)
        if killer is not None:
            killer.mid_step(step)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean(loss.detach(), world))
        hashes.append(_hash(model))
    if save_to:
        accelerator.save_state(save_to)
    return {"losses": losses, "hashes": hashes, "wrapped": type(model).__name__}


def accelerate_runs(rank, world, steps):
    _quiet()
    out = {"stock": accelerate_train(rank, world, None, steps),
           "none": accelerate_train(rank, world, "none", steps)}
    commpress.reset_stats()
    out["int4"] = accelerate_train(rank, world, INT4, steps)
    out["int4"]["stats"] = commpress.stats()
    return out


def accelerate_checkpointing(rank, world, directory):
    """The hook state handed to accelerate's ``register_for_checkpointing``: saved after 2
    steps, loaded into a fresh run → each rank's refusal of ``load_state``, or None."""
    _quiet()
    accelerate_train(rank, world, EF, 2, save_to=directory)
    try:
        accelerate_train(rank, world, EF, 0, load_from=directory)
    except ValueError as e:
        return str(e)
    return None


def accelerate_killed_mid_step(rank, world, victim):
    """int4 through the README recipe; the victim SIGKILLs itself after the forward pass
    of step 2."""
    from tests.reliability.killing import Killer

    _quiet()
    killer = Killer(rank, victim, at_step=2)
    return killer.survive(lambda: accelerate_train(rank, world, INT4, 1000, killer))


def everything(rank, world, directory, steps):
    return {"lightning": lightning_runs(rank, world, directory, steps),
            "accelerate": accelerate_runs(rank, world, steps)}


def lightning_save(rank, world, ckpt, steps):
    """A fit of ``steps`` steps with the error-feedback codec that saves ``ckpt``."""
    from commpress.engines.lightning import CommpressDDPStrategy

    _quiet()
    lightning_fit(rank, world, CommpressDDPStrategy(EF), steps, save_to=ckpt)
    dist.barrier()


def lightning_elastic(rank, world, ckpt, directory, steps):
    """``ckpt`` (saved on another number of ranks, at global step ``steps``) resumed with
    ``CommpressDDPStrategy``: as it is (refused), with ``elastic=True``, and with it from a
    copy without commpress's files (the codecs fresh by construction: the control)."""
    import logging
    import shutil

    from commpress.engines.lightning import CommpressDDPStrategy

    _quiet()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    stripped = os.path.join(directory, "stripped.ckpt")
    if rank == 0:
        shutil.copy(ckpt, stripped)
    dist.barrier()
    out = {}
    try:
        lightning_fit(rank, world, CommpressDDPStrategy(EF), steps, start=steps, ckpt_path=ckpt)
        out["strict"] = None
    except ValueError as e:
        out["strict"] = str(e)
    for name, path in (("elastic", ckpt), ("control", stripped)):
        out[name] = lightning_fit(rank, world, CommpressDDPStrategy(EF, elastic=True), steps,
                                  start=steps, ckpt_path=path)
    out["said"] = [m for m in records if "start fresh" in m]
    return out
