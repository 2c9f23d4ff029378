"""Per-rank DeepSpeed runs for the engine tests (module level: picklable).

Importing DeepSpeed and building an engine cost tens of seconds per process, so each
worker runs several engines one after another in the same ranks.
"""

import hashlib
import importlib
import logging
import os

import torch
import torch.distributed as dist

import commpress
from commpress.engines import rank_state
from commpress.model.gpt import GPT, config_from_preset
from commpress.train.data import TextData, load_tokens

SEQ, BATCH = 32, 8  # global batch per step; each rank takes its share
BUCKET = 20_000  # elements: several buckets, one owner boundary inside a bucket


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed's CPU communicator compiles a shared-memory op (minutes) that only its
    # inference all-reduce uses; training runs without it
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def config(stage=2, accumulation=1, overlap=True, multi_rank=True, world=2, bf16=False):
    """ZeRO ``stage``; ``bf16`` weights accumulate gradients in fp32 (DeepSpeed then keeps
    each rank's reduced gradients in an fp32 partition buffer)."""
    return {
        "bf16": {"enabled": bf16},
        "data_types": {"grad_accum_dtype": "fp32"},
        "train_micro_batch_size_per_gpu": BATCH // world // accumulation,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                              "allgather_bucket_size": BUCKET, "overlap_comm": overlap,
                              "contiguous_gradients": True, "reduce_scatter": True,
                              "use_multi_rank_bucket_allreduce": multi_rank},
        "steps_per_print": 10**9,
    }


def engine_for(cfg, policy=None, topology=None):
    """A fresh gpt-tiny engine (same seed on every rank), compressed when ``policy``."""
    deepspeed = _deepspeed()
    torch.manual_seed(0)
    model = GPT(config_from_preset("gpt-tiny", block_size=SEQ))
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=model.parameters())
    if policy is not None:
        commpress.deepspeed.compress(engine, policy, topology=topology)
    return engine


def weights_hash(engine):
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(engine, data, start, steps, rank, world):
    """``steps`` optimizer steps; per step the mean loss over ranks and the weights."""
    accumulation = engine.gradient_accumulation_steps()
    micro = BATCH // world // accumulation
    losses, hashes = [], []
    for step in range(start, start + steps):
        x, y = data.batch("train", BATCH, SEQ, 0, step)
        total = 0.0
        for m in range(accumulation):
            lo = rank * (BATCH // world) + m * micro
            _, loss = engine(x[lo:lo + micro], y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item() / accumulation
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / world)
        hashes.append(weights_hash(engine))
    return losses, hashes


def run(engine, data, rank, world, steps):
    commpress.reset_stats()
    losses, hashes = train(engine, data, 0, steps, rank, world)
    return {"losses": losses, "hashes": hashes, "stats": commpress.stats(),
            "numel": sum(p.numel() for p in engine.module.parameters())}


def runs(rank, world, cases, steps):
    """Each ``(name, config kwargs, policy)`` case trained ``steps`` steps; by name."""
    data = TextData(load_tokens(max_bytes=200_000))
    out = {}
    for name, kwargs, policy in cases:
        engine = engine_for(config(world=world, **kwargs), policy)
        out[name] = run(engine, data, rank, world, steps)
        out[name]["partition"] = [len(f) // world for f in engine.optimizer.bit16_groups_flat]
        if policy is not None:
            engine.commpress.remove()
    return out


def everything(rank, world, cases, directory, steps):
    """The cases, the refusals and a resumed run, in one set of ranks."""
    return {"cases": runs(rank, world, cases, steps), "refusals": refusals(rank, world),
            "resume": resume(rank, world, directory, steps)}


# error feedback, stochastic rounding and qWD: a resumed run is the same run only if
# the residuals, the rounding counters and the own weights come back
STATEFUL = {"name": "stateful",
            "dp": {"grad": {"codec": "int4:rounding=stochastic", "error_feedback": True},
                   "param": {"codec": "int4:group=2048", "delta": True}}}


def resume(rank, world, directory, steps):
    """Train 2·steps uninterrupted; train steps, save, and continue in a new engine."""
    data = TextData(load_tokens(max_bytes=200_000))
    engine = engine_for(config(world=world), STATEFUL)
    first, _ = train(engine, data, 0, steps, rank, world)
    engine.save_checkpoint(directory, tag="half")
    residuals = sum(float(r.abs().sum()) for b in engine.commpress.grad_buckets.values()
                    for r in b.grad.memories["single"].residuals.values())
    uninterrupted = train(engine, data, steps, steps, rank, world)
    engine.commpress.remove()
    resumed_engine = engine_for(config(world=world), STATEFUL)
    resumed_engine.load_checkpoint(directory, tag="half")
    resumed = train(resumed_engine, data, steps, steps, rank, world)
    # control: the same checkpoint with the codecs' state left fresh
    fresh_engine = engine_for(config(world=world), STATEFUL)
    fresh = fresh_engine.commpress.state_dict()
    fresh_engine.load_checkpoint(directory, tag="half")
    fresh_engine.commpress.load_state_dict(fresh)
    fresh_codecs = train(fresh_engine, data, steps, steps, rank, world)
    fresh_engine.commpress.remove()
    # rank 1's file truncated: refused on every rank, naming it; then a checkpoint
    # without commpress's files: refused on every rank, not half-loaded
    path = rank_state.file_of(os.path.join(directory, "half"))
    dist.barrier()
    if rank == 1:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    truncated = _load_error(resumed_engine, directory)
    os.remove(path)
    dist.barrier()
    refused = _load_error(resumed_engine, directory)
    # a file under the name an older commpress gave rank 0's: named as such
    if rank == 0:
        with open(os.path.join(os.path.dirname(path), "commpress_rank00000.pt"), "wb") as f:
            f.write(b"commpress.deepspeed/2")
    dist.barrier()
    older = _load_error(resumed_engine, directory)
    resumed_engine.commpress.remove()
    return {"first": first, "uninterrupted": uninterrupted, "resumed": resumed,
            "fresh codecs": fresh_codecs, "residuals": residuals, "refused": refused,
            "truncated": truncated, "older": older}


def _load_error(engine, directory, tag="half"):
    try:
        engine.load_checkpoint(directory, tag=tag)
    except ValueError as e:
        return str(e)
    return None


def refusals(rank, world):
    """What compress refuses, by case: the message (None: accepted)."""
    deepspeed = _deepspeed()
    from deepspeed.runtime.zero import stage_1_and_2

    stock_gather = stage_1_and_2.all_gather_dp_groups
    out = {}
    for name, change, bf16 in (("stage 0", {"stage": 0}, False),
                               ("stage 3", {"stage": 3}, False),
                               ("ZeRO++ qgZ", {"zero_quantized_gradients": True}, False),
                               ("reduce_scatter false", {"reduce_scatter": False}, False),
                               ("bf16 stage 1", {"stage": 1}, True)):
        cfg = config(world=world, bf16=bf16)
        cfg["zero_optimization"].update(change)
        engine = engine_for(cfg)
        try:
            commpress.deepspeed.compress(engine, "sdp4bit")
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        del engine
    # undo gives the engine DeepSpeed's own methods and gather back
    engine = engine_for(config(world=world), "zeropp")
    patched = stage_1_and_2.all_gather_dp_groups is not stock_gather
    engine.commpress.remove()
    out["undo"] = {"patched": patched,
                   "gather restored": stage_1_and_2.all_gather_dp_groups is stock_gather,
                   "methods restored": all(n not in vars(engine.optimizer) for n in (
                       "average_tensor", "allreduce_and_scatter", "allreduce_no_retain")),
                   "checkpoints restored": "save_checkpoint" not in vars(engine)}
    del deepspeed
    return out


def elastic(rank, world, directory, load_tag, save_tag, start, copy_state):
    """From step ``start``: resume ``load_tag`` (saved on another data-parallel size;
    None: start fresh), converted to a universal checkpoint by rank 0 (``copy_state``:
    commpress's files copied beside), three ways: compressed as before (refused),
    compressed with ``elastic=True``, and stock DeepSpeed compressed only after its load
    (fresh codecs, the control); each trains 2 steps. Saves the elastic run as
    ``save_tag``."""
    import argparse
    import contextlib
    import glob
    import io
    import shutil

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    data = TextData(load_tokens(max_bytes=200_000))
    cfg = config(world=world)
    out = {}
    if load_tag is None:
        engine = engine_for(cfg, STATEFUL)
        train(engine, data, start, 2, rank, world)
    else:
        universal = f"{load_tag}_universal"
        if rank == 0:
            from deepspeed.checkpoint import ds_to_universal
            args = argparse.Namespace(
                input_folder=os.path.join(directory, load_tag),
                output_folder=os.path.join(directory, universal), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=True)
            with contextlib.redirect_stdout(io.StringIO()):
                ds_to_universal.main(args)
            for f in glob.glob(os.path.join(directory, load_tag, "commpress-rank*.pt")):
                if copy_state:
                    shutil.copy(f, os.path.join(directory, universal))
        dist.barrier()
        cfg["checkpoint"] = {"load_universal": True}
        strict = engine_for(cfg, STATEFUL)
        out["strict"] = _load_error(strict, directory, universal)
        strict.commpress.remove()
        control = engine_for(cfg)
        control.load_checkpoint(directory, tag=universal)
        out["loaded"] = weights_hash(control)
        commpress.deepspeed.compress(control, STATEFUL)
        out["control"] = train(control, data, start, 2, rank, world)
        control.commpress.remove()
        engine = engine_for(cfg)
        commpress.deepspeed.compress(engine, STATEFUL, elastic=True)
        engine.load_checkpoint(directory, tag=universal)
        out["elastic"] = train(engine, data, start, 2, rank, world)
    engine.save_checkpoint(directory, tag=save_tag)
    engine.commpress.remove()
    out["logged"] = [m for m in records if "start fresh" in m]
    return out


def one_rank_compresses(rank, world):
    """Rank 0 compresses, rank 1 trains stock DeepSpeed: what each raised, how soon."""
    import time

    data = TextData(load_tokens(max_bytes=200_000))
    start = time.monotonic()
    try:
        engine = engine_for(config(world=world), "sdp4bit" if rank == 0 else None)
        train(engine, data, 0, 1, rank, world)
        error = None
    except Exception as e:  # noqa: BLE001 - what the rank saw, for the test
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - start}


def killed_mid_step(rank, world, victim):
    """sdp4bit ZeRO-2; the victim SIGKILLs itself between its forward and backward."""
    from tests.reliability.killing import Killer

    data = TextData(load_tokens(max_bytes=200_000))
    engine = engine_for(config(world=world), "sdp4bit")
    killer = Killer(rank, victim, at_step=2)
    per = BATCH // world

    def loop():
        for step in range(1000):
            x, y = data.batch("train", BATCH, SEQ, 0, step)
            _, loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            killer.mid_step(step)
            engine.backward(loss)
            engine.step()

    return killer.survive(loop)


class _ExpertMLP(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.fc(x)))


class _DeepSpeedMoE(torch.nn.Module):
    """A block's MLP as DeepSpeed's MoE (4 experts, top-2, over ``ep`` ranks); its
    load-balancing loss is left out (the tests watch the communication)."""

    def __init__(self, d, ep):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(hidden_size=d, expert=_ExpertMLP(d), num_experts=4, ep_size=ep, k=2,
                       min_capacity=4)

    def forward(self, x):
        return self.moe(x)[0]


def moe_runs(rank, world, cases, steps, ep):
    """gpt-tiny with DeepSpeed MoE blocks, ZeRO-2, per ``(name, policy)`` case: losses,
    the weights' hash per step, the experts' and the dense weights' final hash apart,
    and the bytes per label."""
    _deepspeed()
    data = TextData(load_tokens(max_bytes=200_000))
    out = {}
    for name, policy in cases:
        torch.manual_seed(0)
        model = GPT(config_from_preset("gpt-tiny", block_size=SEQ))
        for block in model.blocks:
            block.mlp = _DeepSpeedMoE(model.cfg.n_embd, ep)
        deepspeed = _deepspeed()
        engine, *_ = deepspeed.initialize(model=model, config=config(world=world),
                                          model_parameters=model.parameters())
        if policy is not None:
            commpress.deepspeed.compress(engine, policy)
        result = run(engine, data, rank, world, steps)
        experts = [p for n, p in engine.module.named_parameters() if ".experts." in n]
        dense = [p for n, p in engine.module.named_parameters() if ".experts." not in n]
        result["experts"], result["dense"] = (_hash(experts), _hash(dense))
        out[name] = result
        if policy is not None:
            engine.commpress.remove()
    return out


def _hash(params):
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
