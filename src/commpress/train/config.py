"""Configuration of a training run: one frozen dataclass, checked once, logged with the run."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from commpress.model.gpt import PRESETS as MODEL_PRESETS
from commpress.policy import Policy


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; the field comments are the CLI's help."""

    policy: str = "hybrid"  # preset name (none, naive, hybrid, sdp4bit, zeropp, ...) or file
    dp: int | None = None  # data-parallel degree (default: nproc / (tp · pp))
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    nproc: int | None = None  # ranks to spawn on CPU (default: dp · tp · pp, or 4)
    ranks_per_node: int | None = None  # ranks per node (default: LOCAL_WORLD_SIZE or all)
    model: str = "gpt-1m"  # model preset
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 128  # tokens per sequence
    micro_batches: int | None = None  # per step and rank (default: pp)
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decay to lr · this
    warmup: int = 30  # linear warm-up steps
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0  # global-norm clipping (None: off)
    seed: int = 0
    data: str | None = None  # text file, folder or .bin (default: Python's stdlib sources)
    max_data_bytes: int = 8 << 20  # read at most this much of the corpus
    eval_every: int = 100  # steps between validation evaluations
    eval_batches: int = 8  # validation batches per evaluation
    out: str | None = None  # run directory (default: runs/<policy>-dp…-s<seed>)
    checkpoint_every: int = 0  # steps between checkpoints, and one at the end (0: none)
    resume: str | None = None  # checkpoint file or run directory to continue
    nonfinite: str = "skip"  # on a NaN/Inf gradient: skip the step, or raise
    timeout_s: float = 120.0  # collective timeout: a dead peer becomes an error, not a hang
    bucket_numel: int = 1 << 20  # elements per gradient bucket
    progress: bool = True  # show a progress bar on rank 0
    dtype: str = "fp32"  # training dtype of the model: fp32, bf16 or fp16 (masters stay fp32)
    engine: str = "sharded"  # data parallelism: sharded (commpress ZeRO) or ddp (torch DDP)
    ddp_hook: str = "commpress"  # with --engine ddp: allreduce, fp16, powersgd:R, commpress

    def __post_init__(self) -> None:
        Policy.resolve(self.policy)  # an unknown preset or a bad file fails here
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model={self.model!r} is not allowed; allowed: "
                             f"{', '.join(MODEL_PRESETS)}")
        for name in ("tp", "pp", "steps", "batch_size", "seq_len", "eval_batches",
                     "bucket_numel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is not allowed; allowed: >= 1")
        for name in ("dp", "nproc", "ranks_per_node", "micro_batches"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v} is not allowed; allowed: >= 1 or unset")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype={self.dtype!r} is not allowed; allowed: fp32, bf16, fp16")
        if self.engine not in ("sharded", "ddp"):
            raise ValueError(f"engine={self.engine!r} is not allowed; allowed: sharded, ddp")
        if self.engine == "ddp" and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"engine=ddp runs data parallelism only; got tp={self.tp}, "
                             f"pp={self.pp}: use engine=sharded for tp/pp")
        hook = self.ddp_hook
        if hook not in ("allreduce", "fp16", "commpress") and not (
                hook.startswith("powersgd:") and hook.split(":")[1].isdigit()):
            raise ValueError(f"ddp_hook={hook!r} is not allowed; allowed: allreduce, fp16, "
                             "powersgd:RANK (e.g. powersgd:4), commpress")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite={self.nonfinite!r} is not allowed; allowed: skip, raise")
        if self.seq_len > MODEL_PRESETS[self.model].block_size:
            raise ValueError(f"seq_len={self.seq_len} exceeds model {self.model!r} block_size "
                             f"{MODEL_PRESETS[self.model].block_size}")
        if self.data is not None and not os.path.exists(self.data):
            raise ValueError(f"data={self.data!r} does not exist; allowed: a text file, a folder "
                             "of text files, or a uint16 .bin file")
        if self.checkpoint_every < 0 or self.eval_every < 0:
            raise ValueError("checkpoint_every and eval_every must be >= 0")

    def resolved(self, world: int | None = None) -> TrainConfig:
        """Fill dp, nproc, micro_batches and out; check the layout against the world size."""
        mp = self.tp * self.pp
        world = world or self.nproc or (self.dp * mp if self.dp else 4 if mp == 1 else mp)
        dp = self.dp or max(1, world // mp)
        if dp * mp != world:
            raise ValueError(f"world size {world} is not dp × tp × pp = {dp} × {self.tp} × "
                             f"{self.pp}; allowed: a world size equal to their product")
        rpn = self.ranks_per_node
        if rpn is not None and world % rpn:
            raise ValueError(f"world size {world} is not divisible by ranks_per_node={rpn}")
        micro = self.micro_batches or self.pp
        if self.batch_size % (dp * micro):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by dp × "
                             f"micro_batches = {dp} × {micro}")
        layout = f"dp{dp}tp{self.tp}pp{self.pp}"
        out = self.out or f"runs/{policy_slug(self.policy)}-{layout}-s{self.seed}"
        return dataclasses.replace(self, dp=dp, nproc=world, micro_batches=micro, out=out)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def policy_slug(policy: str) -> str:
    """A policy's name for paths: the preset name, or a policy file's stem."""
    return os.path.splitext(os.path.basename(policy))[0]


def field_help() -> dict[str, str]:
    """Field name → the comment beside it (the CLI's --help text)."""
    import inspect

    src = inspect.getsource(TrainConfig)
    out = {}
    for line in src.splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith(("#", '"')):
            name = line.split(":", 1)[0].strip()
            out[name] = line.split("#", 1)[1].strip()
    return out
