"""Configuration of a training run: one frozen dataclass, checked once, logged with the run."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from commpress.frontends.diloco import DiLoCoConfig, outer_policy, outer_step
from commpress.model.gpt import PRESETS as MODEL_PRESETS
from commpress.policy import Policy
from commpress.validate import MAX_SEED, InputError, check_float, check_int, check_path

MAX_TIMEOUT_S = 1_000_000  # about 11.6 days: longer than any wait worth waiting for
# the --dtype names (of the model, and of the benchmarks' tensors)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# the DiLoCo schedule's fields: meaningful with --outer only
OUTER_OPTIONS = ("sync_every", "fragments", "outer_delay", "outer_lr", "outer_momentum")


def _opt(default, help: str):
    """A field whose ``help`` is its ``--help`` text (one sentence, defaults said once)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; each field's help is the CLI's ``--help`` for it."""

    policy: str = _opt("hybrid",
                       "a preset (none, naive, hybrid, sdp4bit, zeropp, …) or a YAML/TOML file")
    fallback: str | None = _opt(None, "measured: each data-parallel bucket times its "
                                      "collectives compressed and exact in its first steps "
                                      "and keeps compression only where it is faster; off; "
                                      "default: the policy's (off unless its file says)")
    guard: str | None = _opt(None, "the convergence guard of the data-parallel gradients: a "
                                   "relative-error budget (0.3), or max_rel_error=0.3,"
                                   "window=3,every=10; a bucket over it is promoted to more "
                                   "bits; default: the policy's (off unless its file says)")
    dp: int | None = _opt(None, "data-parallel degree; default: the ranks / (tp · pp)")
    tp: int = _opt(1, "tensor-parallel degree")
    pp: int = _opt(1, "pipeline-parallel degree")
    ep: int = _opt(1, "expert-parallel degree (a moe-* model): ep consecutive data-parallel "
                      "ranks share one copy of the experts, their tokens sent with the "
                      "policy's ep codecs")
    nproc: int | None = _opt(None, "ranks to spawn; default: dp · tp · pp, or 4")
    ranks_per_node: int | None = _opt(None,
                                      "ranks that share a node; default: LOCAL_WORLD_SIZE, else "
                                      "all")
    model: str = _opt("gpt-1m", f"model preset: {', '.join(MODEL_PRESETS)}")
    steps: int = _opt(300, "optimizer steps")
    batch_size: int = _opt(16, "global batch in sequences")
    seq_len: int = _opt(128, "tokens per sequence")
    micro_batches: int | None = _opt(None, "micro-batches per step and rank; default: pp")
    lr: float = _opt(3e-3, "peak learning rate of AdamW")
    min_lr_ratio: float = _opt(0.1, "the cosine schedule ends at lr times this")
    warmup: int = _opt(30, "steps of linear learning-rate warm-up")
    weight_decay: float = _opt(0.1, "AdamW weight decay of matrices (not of biases and norms)")
    max_grad_norm: float | None = _opt(1.0,
                                       "clip the global gradient norm to this; none turns it off")
    seed: int = _opt(0, "seed of the initialization and of the batch order")
    data: str | None = _opt(None,
                            "a text file, a folder of text files or a uint16 .bin; default: "
                            "Python's own sources")
    max_data_bytes: int = _opt(8 << 20, "read at most this many bytes of the corpus")
    eval_every: int = _opt(100, "steps between validation evaluations (0: only at the end)")
    eval_batches: int = _opt(8, "validation batches per evaluation")
    out: str | None = _opt(None, "run directory; default: runs/<policy>-dp…tp…pp…-s<seed>")
    checkpoint_every: int = _opt(0, "steps between checkpoints, plus one at the end (0: none)")
    resume: str | None = _opt(None, "a run directory or checkpoint step directory to continue")
    nonfinite: str = _opt("skip", "on a NaN or Inf gradient: skip the step, or raise")
    timeout_s: float = _opt(120.0, "seconds before a collective waiting for a dead peer fails")
    bucket_numel: int = _opt(1 << 20, "elements per gradient bucket")
    progress: bool = _opt(True, "show a progress bar on rank 0")
    tensorboard: bool = _opt(False, "also write each step's loss, time, bytes and guard signals "
                             "as TensorBoard scalars to OUT/tensorboard")
    dtype: str = _opt("fp32", "model dtype: fp32, bf16 or fp16 (master weights stay fp32)")
    engine: str = _opt("sharded", "data parallelism: sharded (commpress ZeRO) or ddp (torch DDP)")
    ddp_hook: str = _opt("commpress",
                         "the DDP hook with --engine ddp: allreduce, fp16, powersgd:R or commpress")
    outer: str = _opt("none",
                      "with --engine ddp: DDP inside each node (a site), DiLoCo across sites: "
                      "none, a DiLoCo preset (diloco, diloco-int8, diloco-int4, diloco-int2ef, "
                      "diloco-sparse) or a policy file with outer.grad")
    sync_every: int = _opt(32, "with --outer: inner steps between two syncs (DiLoCo's H)")
    fragments: int = _opt(1, "with --outer: Streaming DiLoCo's fragments, one synced every "
                             "sync_every / fragments steps")
    outer_delay: int = _opt(0, "with --outer: inner steps a fragment's all-reduce overlaps")
    outer_lr: float | None = _opt(None, "with --outer: learning rate of the outer Nesterov "
                                        "SGD; none (the default): the preset's (0.7, "
                                        "diloco-sparse 1)")
    outer_momentum: float | None = _opt(None, "with --outer: momentum of the outer Nesterov "
                                              "SGD, 0 for none; none (the default): the "
                                              "preset's (0.9, diloco-sparse 0)")
    device: str | None = _opt(None, "cpu or cuda; default: cuda when a GPU is visible")
    backend: str | None = _opt(None, "gloo or nccl; default: nccl on cuda, gloo on cpu")

    def __post_init__(self) -> None:
        # an unknown preset, a bad file or fallback fails here
        self.policy_object()
        if self.model not in MODEL_PRESETS:
            raise InputError(f"model={self.model!r} is not allowed; allowed: "
                             f"{', '.join(MODEL_PRESETS)}")
        self._check_numbers()
        for name in ("data", "out", "resume"):
            check_path(name, getattr(self, name), optional=True)
        if self.dtype not in DTYPES:
            raise InputError(f"dtype={self.dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if self.engine not in ("sharded", "ddp"):
            raise InputError(f"engine={self.engine!r} is not allowed; allowed: sharded, ddp")
        if self.engine == "ddp" and (self.tp > 1 or self.pp > 1 or self.ep > 1):
            raise InputError(f"engine=ddp runs data parallelism only; got tp={self.tp}, "
                             f"pp={self.pp}, ep={self.ep}: use engine=sharded for tp/pp/ep")
        self._check_experts()
        if (self.policy_object().guard is not None and self.engine == "ddp"
                and self.ddp_hook != "commpress" and self.outer == "none"):
            raise InputError(f"guard={self.guard!r} with ddp_hook={self.ddp_hook!r} is not "
                             "allowed; allowed: the guard with engine=sharded, engine=ddp "
                             "with ddp_hook=commpress (the hooks of torch send what they "
                             "send), or --outer (DiLoCo's pseudo-gradients guarded)")
        hook = self.ddp_hook
        rank = hook.removeprefix("powersgd:")
        if hook not in ("allreduce", "fp16", "commpress") and not (
                hook.startswith("powersgd:") and rank.isdecimal() and int(rank) >= 1):
            raise InputError(f"ddp_hook={hook!r} is not allowed; allowed: allreduce, fp16, "
                             "powersgd:RANK with RANK >= 1 (e.g. powersgd:4), commpress")
        if self.outer != "none":
            outer_policy(self.outer)  # an unknown preset or a bad file fails here
            if self.engine != "ddp":
                raise InputError(f"outer={self.outer!r} needs engine=ddp (DDP inside a site); "
                                 f"got engine={self.engine!r}")
        else:  # the schedule's options do nothing without --outer: never silently dropped
            # (resolved() fills the outer step's defaults in: not given either)
            unset = dict(zip(("outer_lr", "outer_momentum"), outer_step("none"), strict=True))
            given = [f"{name}={getattr(self, name)!r}" for name in OUTER_OPTIONS
                     if getattr(self, name) not in (
                         TrainConfig.__dataclass_fields__[name].default, unset.get(name))]
            if given:
                raise InputError(f"{', '.join(given)} given without outer; allowed: those "
                                 "options with outer=PRESET (DiLoCo across sites), or none of "
                                 "them")
        if self.nonfinite not in ("skip", "raise"):
            raise InputError(f"nonfinite={self.nonfinite!r} is not allowed; allowed: skip, raise")
        if self.seq_len > MODEL_PRESETS[self.model].block_size:
            raise InputError(f"seq_len={self.seq_len} exceeds model {self.model!r} block_size "
                             f"{MODEL_PRESETS[self.model].block_size}")
        if self.data is not None and not os.path.exists(self.data):
            raise InputError(f"data={self.data!r} does not exist; allowed: a text file, a folder "
                             "of text files, or a uint16 .bin file")
        if self.device not in (None, "cpu", "cuda"):
            raise InputError(f"device={self.device!r} is not allowed; allowed: cpu, cuda")
        if self.backend not in (None, "gloo", "nccl"):
            raise InputError(f"backend={self.backend!r} is not allowed; allowed: gloo, nccl")
        if self.backend == "nccl" and self.device == "cpu":
            raise InputError("backend=nccl needs device=cuda; allowed with device=cpu: gloo")

    def policy_object(self) -> Policy:
        """The run's :class:`Policy`: ``policy`` with ``fallback`` and ``guard`` when
        given."""
        return Policy.resolve(self.policy).with_fallback(self.fallback).with_guard(
            parse_guard(self.guard))

    def _check_experts(self) -> None:
        """Expert parallelism needs a mixture of experts it divides; tensor parallelism of
        one is not built."""
        shape = MODEL_PRESETS[self.model]
        if self.ep > 1 and not shape.moe:
            moe = [name for name, m in MODEL_PRESETS.items() if m.moe]
            raise InputError(f"ep={self.ep} needs a mixture-of-experts model; model="
                             f"{self.model!r} is dense; allowed: ep=1, or a model of "
                             f"{', '.join(moe)}")
        if shape.moe and shape.n_expert % self.ep:
            raise InputError(f"ep={self.ep} does not divide model {self.model!r}'s "
                             f"{shape.n_expert} experts; allowed: a divisor of {shape.n_expert}")
        if shape.moe and self.tp > 1:
            raise InputError(f"tp={self.tp} with the mixture of experts {self.model!r}: "
                             "tensor parallelism of experts is not built; allowed: tp=1 "
                             "(spread the experts with ep instead)")
        if self.dp is not None and self.dp % self.ep:
            raise InputError(f"ep={self.ep} does not divide dp={self.dp}; allowed: an "
                             "expert-parallel degree dividing the data-parallel degree "
                             "(expert parallelism borrows data-parallel ranks)")

    def _check_numbers(self) -> None:
        """Every numeric field finite and in range, before anything else reads it."""
        for name in ("tp", "pp", "ep", "steps", "batch_size", "seq_len", "eval_batches",
                     "bucket_numel", "max_data_bytes"):
            check_int(name, getattr(self, name), ge=1)
        for name in ("dp", "nproc", "ranks_per_node", "micro_batches"):
            check_int(name, getattr(self, name), ge=1, optional=True)
        for name in ("warmup", "eval_every", "checkpoint_every"):
            check_int(name, getattr(self, name), ge=0)
        # the DiLoCo schedule, with or without --outer: a bad value is never silently kept
        check_int("outer_delay", self.outer_delay, ge=0)
        DiLoCoConfig(self.sync_every, self.fragments, self.outer_delay,
                     *outer_step(self.outer, self.outer_lr, self.outer_momentum))
        # the batch sampler seeds a generator with seed · 1_000_003 + 2 · step, which
        # must fit in 64 bits
        check_int("seed", self.seed, ge=0, le=MAX_SEED)
        check_float("lr", self.lr, gt=0)
        check_float("min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        check_float("weight_decay", self.weight_decay, ge=0)
        check_float("max_grad_norm", self.max_grad_norm, gt=0, optional=True)
        check_float("timeout_s", self.timeout_s, gt=0, le=MAX_TIMEOUT_S)

    def resolved(self, world: int | None = None) -> TrainConfig:
        """Fill dp, nproc, micro_batches, out and the outer step; check the layout against
        the world size."""
        mp = self.tp * self.pp
        world = world or self.nproc or (self.dp * mp if self.dp else 4 if mp == 1 else mp)
        dp = self.dp or max(1, world // mp)
        if dp * mp != world:
            raise InputError(f"world size {world} is not dp × tp × pp = {dp} × {self.tp} × "
                             f"{self.pp}; allowed: a world size equal to their product")
        rpn = self.ranks_per_node
        if rpn is not None and world % rpn:
            raise InputError(f"world size {world} is not divisible by ranks_per_node={rpn}")
        micro = self.micro_batches or self.pp
        if dp % self.ep:
            raise InputError(f"ep={self.ep} does not divide dp={dp} (world {world} / (tp · "
                             f"pp)); allowed: an expert-parallel degree dividing dp")
        if self.batch_size % (dp * micro):
            raise InputError(f"batch_size={self.batch_size} is not divisible by dp × "
                             f"micro_batches = {dp} × {micro}")
        layout = f"dp{dp}tp{self.tp}pp{self.pp}" + (f"ep{self.ep}" if self.ep > 1 else "")
        outer = "" if self.outer == "none" else f"-{policy_slug(self.outer)}-H{self.sync_every}"
        out = self.out or f"runs/{policy_slug(self.policy)}{outer}-{layout}-s{self.seed}"
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise InputError("device=cuda, but no GPU is visible; allowed here: device=cpu")
        backend = self.backend or ("nccl" if device == "cuda" else "gloo")
        if backend == "nccl" and device != "cuda":
            raise InputError("backend=nccl needs device=cuda; allowed with device=cpu: gloo")
        outer_lr, outer_momentum = outer_step(self.outer, self.outer_lr, self.outer_momentum)
        return dataclasses.replace(self, dp=dp, nproc=world, micro_batches=micro, out=out,
                                   device=device, backend=backend, outer_lr=outer_lr,
                                   outer_momentum=outer_momentum)

    def node_size(self, local_world: int | None = None) -> int:
        """Ranks that share a node (of a resolved config): ``ranks_per_node``, else the
        launcher's ``local_world`` (its LOCAL_WORLD_SIZE), else every rank."""
        return self.ranks_per_node or local_world or self.nproc

    def dp_ranks_per_node(self, local_world: int | None = None) -> int:
        """Data-parallel ranks per node: tensor-parallel slices, then stages, sit innermost
        (the mesh's order), so a node holds ``node_size / (tp · pp)`` of them."""
        return max(1, self.node_size(local_world) // (self.tp * self.pp))

    def diloco_options(self) -> dict:
        """The :class:`~commpress.DiLoCo` arguments of ``--outer``."""
        return {"policy": self.outer, "sync_every": self.sync_every,
                "fragments": self.fragments, "delay": self.outer_delay,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                **({"fallback": self.fallback} if self.fallback else {}),
                **({"guard": parse_guard(self.guard)} if self.guard else {})}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def policy_slug(policy: str) -> str:
    """A policy's name for paths: the preset name, or a policy file's stem."""
    return os.path.splitext(os.path.basename(policy))[0]


def field_help() -> dict[str, str]:
    """Field name → its ``--help`` text."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}


def parse_guard(text: str | None) -> dict | float | None:
    """``--guard``: a budget (``0.3``) or
    ``max_rel_error=0.3,window=3,every=10,max_memory_ratio=4``."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return float(text)
        return {k.strip(): (float(v) if k.strip().startswith("max_") else int(v))
                for k, v in (part.split("=", 1) for part in text.split(","))}
    except ValueError:
        raise InputError(f"guard={text!r} is not allowed; allowed: a positive number (the "
                         "relative-error budget) or max_rel_error=X,window=N,every=N,"
                         "max_memory_ratio=X") from None
