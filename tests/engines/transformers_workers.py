"""Per-rank Hugging Face Trainer runs for the engine tests (module level: picklable): a
tiny GPT2LMHeadModel built from a config (no download) on real text, the Trainer's own
DDP on the Gloo group :func:`commpress.launch.spawn` initialized."""

import hashlib
import logging
import os
import warnings

import torch

import commpress
from commpress.collectives import Topology
from commpress.train.data import TextData, load_tokens

SEQ, BATCH, STEPS = 32, 4, 6


class _Samples(torch.utils.data.Dataset):
    def __init__(self, data, n):
        x, _ = data.batch("train", n, SEQ, 0, 0)
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _quiet():
    warnings.filterwarnings("ignore")
    for name in ("transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _trainer(data, out_dir, steps, *, accumulate=1, unused=False, save_steps=None):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=data.vocab_size, n_positions=SEQ, n_embd=64,
                                       n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    if unused:  # a parameter no loss reaches: DDP needs find_unused_parameters
        model.unused = torch.nn.Linear(4, 4)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0,
        gradient_accumulation_steps=accumulate, max_grad_norm=1.0,
        ddp_find_unused_parameters=unused, dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_Samples(data, 256))


def _run(data, out_dir, steps, policy=None, *, lowrank=None, resume=None, **options):
    trainer = _trainer(data, out_dir, steps, **options)
    if policy is not None or lowrank is not None:
        # each rank a node of its own: int2ef's inter-node codes on two processes
        commpress.transformers.compress(trainer, policy or "none", lowrank=lowrank,
                                        topology=Topology(1))
    commpress.reset_stats()
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "hash": _hash(trainer.model), "stats": commpress.stats(),
            "step": trainer.state.global_step, "remove after": _remove(trainer),
            "files": sorted(f for f in os.listdir(out_dir) if f.startswith("checkpoint"))}


def _compression(trainer):
    found = [c for c in trainer.callback_handler.callbacks
             if type(c).__name__ == "Compression"]
    return found[0] if found else None


def _remove(trainer):
    """What remove() says once training has begun (None: nothing to remove; "removed":
    the Trainer's own ``train`` and callbacks again)."""
    compression = _compression(trainer)
    if compression is None:
        return None
    try:
        compression.remove()
    except commpress.InputError as e:
        return str(e)
    restored = "train" not in vars(trainer) and _compression(trainer) is None
    return "removed" if restored else "left behind"


def remove_before_training(data, out_dir):
    """compress() then remove() before train(): the Trainer is as it was."""
    trainer = _trainer(data, out_dir, 1)
    train = trainer.train
    compression = commpress.transformers.compress(trainer, "int2ef")
    compressed_train = trainer.train
    try:
        compression.state_dict()
        before = None
    except commpress.InputError as e:
        before = str(e)
    compression.remove()
    again = commpress.transformers.compress(trainer, "int2ef")  # allowed once removed
    again.remove()
    return {"train restored": trainer.train == train and compressed_train != train,
            "callback gone": _compression(trainer) is None, "state before training": before}


def everything(rank, world, directory):
    """Every case on one pair of ranks (one start-up)."""
    _quiet()
    data = TextData(load_tokens(max_bytes=200_000))
    d = lambda name: os.path.join(directory, name)  # noqa: E731 - a short path helper
    out = {"stock": _run(data, d("stock"), STEPS),
           "none": _run(data, d("none"), STEPS, "none"),
           "int2ef": _run(data, d("int2ef"), STEPS, "int2ef"),
           "int2ef saved": _run(data, d("saved"), STEPS, "int2ef", save_steps=STEPS // 2),
           "accumulate unused": _run(data, d("acc"), STEPS, "int2ef", accumulate=2,
                                     unused=True),
           "lowrank": _run(data, d("lowrank"), STEPS, lowrank={"rank": 2, "start_iter": 1})}
    out["remove before"] = remove_before_training(data, d("remove"))
    out["files in checkpoint"] = sorted(os.listdir(
        os.path.join(d("saved"), f"checkpoint-{STEPS // 2}")))
    out["int2ef resumed"] = _run(data, d("saved"), STEPS, "int2ef",
                                 resume=os.path.join(d("saved"), f"checkpoint-{STEPS // 2}"))
    return out


def killed_mid_step(rank, world, victim, directory):
    """int2ef (each rank a node) in the Trainer; the victim SIGKILLs itself after the
    forward pass of step 2 (a forward hook on the model)."""
    from tests.reliability.killing import Killer

    _quiet()
    data = TextData(load_tokens(max_bytes=200_000))
    trainer = _trainer(data, directory, 1000)
    commpress.transformers.compress(trainer, "int2ef", topology=Topology(1))
    killer = Killer(rank, victim, at_step=2)
    trainer.model.register_forward_hook(
        lambda *_: killer.mid_step(trainer.state.global_step))
    return killer.survive(trainer.train)


def resume_without_state(rank, world, directory):
    """A checkpoint saved without commpress, resumed with it: refused, naming the way on;
    resumed that way (``elastic=True``, the same number of ranks): trains on."""
    _quiet()
    data = TextData(load_tokens(max_bytes=200_000))
    _run(data, directory, 2, save_steps=1)
    try:
        _run(data, directory, 2, "int2ef", resume=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    trainer = _trainer(data, directory, 3)
    commpress.transformers.compress(trainer, "int2ef", topology=Topology(1), elastic=True)
    trainer.train(resume_from_checkpoint=True)
    return {"refused": refused, "step": trainer.state.global_step, "hash": _hash(trainer.model)}


def save_int2ef(rank, world, directory):
    """An int2ef run that saves a checkpoint halfway, in ``directory``."""
    _quiet()
    _run(TextData(load_tokens(max_bytes=200_000)), directory, STEPS, "int2ef",
         save_steps=STEPS // 2)


def elastic_resume(rank, world, checkpoint, directory):
    """``checkpoint`` (saved on another number of ranks) resumed: as it is (refused), with
    ``elastic=True``, and with ``elastic=True`` from a copy without commpress's files (the
    codecs fresh by construction: the control)."""
    import shutil

    _quiet()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    data = TextData(load_tokens(max_bytes=200_000))
    stripped = os.path.join(directory, "stripped", os.path.basename(checkpoint))
    if rank == 0:
        shutil.copytree(checkpoint, stripped,
                        ignore=shutil.ignore_patterns("commpress-rank*"))
    torch.distributed.barrier()
    out = {}
    try:
        _run(data, os.path.join(directory, "strict"), STEPS, "int2ef", resume=checkpoint)
        out["strict"] = None
    except ValueError as e:
        out["strict"] = str(e)
    for name, resume in (("elastic", checkpoint), ("control", stripped)):
        trainer = _trainer(data, os.path.join(directory, name), STEPS)
        commpress.transformers.compress(trainer, "int2ef", topology=Topology(1), elastic=True)
        trainer.train(resume_from_checkpoint=resume)
        out[name] = {"hash": _hash(trainer.model), "step": trainer.state.global_step}
    out["said"] = [m for m in records if "start fresh" in m]
    return out
