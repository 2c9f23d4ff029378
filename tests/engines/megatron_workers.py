"""Per-rank Megatron-core training for the engine tests (module level: picklable).

A tiny Megatron GPT (2 layers, hidden 64, 4 heads, byte vocabulary of 256, sequence
32) in bf16, wrapped in Megatron's own ``DistributedDataParallel`` and optimizer,
trained on the project's default corpus (the Python standard library's sources).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SEQ, BATCH, MICRO = 32, 8, 2  # global batch of 8 sequences, micro-batches of 2


@dataclass(frozen=True)
class Shape:
    """The GPT and its batches (the tests' tiny one by default)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = SEQ
    batch: int = BATCH  # sequences per step, over all data-parallel ranks
    micro: int = MICRO  # sequences per micro-batch


TINY = Shape()


def cpu_shim() -> None:
    """TEST-ONLY: let Megatron-core 0.16 run on a CPU-only torch with Gloo.

    Megatron assumes CUDA in a few places: ``device='cuda'`` tensors (optimizer flags,
    schedules' token counts, the gradient-norm clip), ``torch.cuda.current_device()``
    for buffers, ``torch.cuda.synchronize()`` after pipeline transfers, the
    distributed optimizer's ``torch.cuda.*Tensor`` type check, and the CUDA RNG
    tracker that attention forks for dropout. This process maps them to the CPU. It
    changes torch for the whole process: never import it outside the tests. commpress
    itself uses the tensors' own device and needs none of it.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    real_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):  # a CPU tensor reports itself as CUDA's kind
        kind = real_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return kind
        return kind.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)
    return make


def moe_cpu_shim() -> None:
    """TEST-ONLY: what Megatron-core 0.16.1's all-to-all MoE dispatcher needs on a CPU-only
    torch beyond :func:`cpu_shim`: its router tests a name bound only when Transformer
    Engine imports (moe_utils.te_general_gemm); its constructor makes a CUDA stream for the
    splits' device-to-host copy; and that copy turns the splits into host arrays for CUDA
    tensors only (here they are host tensors already, which all_to_all_single refuses)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as td

    moe_utils.te_general_gemm = None
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

    def splits_to_host(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = splits_to_host


def init_parallel(tp: int, pp: int, timeout_minutes: float = 30, ep: int = 1) -> None:
    cpu_shim()
    moe_cpu_shim()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep,
                                             distributed_timeout_minutes=timeout_minutes)


class SequenceParallelNorm(torch.nn.LayerNorm):
    """TEST-ONLY: Megatron's torch LayerNorm refuses sequence parallelism (its fused norms
    need Apex or Transformer Engine); this is torch's LayerNorm with its parameters marked
    as those mark theirs, so Megatron sums their gradients across TP ranks."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def build(tp: int, pp: int, distopt: bool = True, overlap_param_gather: bool = False,
          sequence_parallel: bool = False, bucket_size: int = 20_000, seed: int = 0,
          shape: Shape = TINY, experts: int = 0):
    """A fresh model, DDP wrapper and optimizer (the same weights for the same seed);
    ``experts``: MoE layers of that many experts (top-2, the all-to-all dispatcher,
    sequential experts), over the expert-parallel size ``init_parallel`` set."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        use_cpu_initialization=True,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
        **({} if not experts else dict(
            num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=2 * shape.hidden,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.01,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())))
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    if sequence_parallel:
        spec.submodules.input_layernorm = SequenceParallelNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * (config.num_layers // pp),
                                          layer_norm=SequenceParallelNorm)
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                   vocab_size=256, max_sequence_length=shape.seq,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt, overlap_grad_reduce=True,
        overlap_param_gather=overlap_param_gather, bucket_size=bucket_size)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, use_distributed_optimizer=distopt,
                        clip_grad=1.0), [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, optimizer


def data():
    from commpress.train.data import TextData, load_tokens

    return TextData(load_tokens(max_bytes=200_000))


def _forward_step(data_iterator, model):
    x, y = next(data_iterator)
    positions = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
    out = model(x, positions, None, labels=y)

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}  # Megatron divides ``loss`` in place

    return out, loss_func


def train(model, optimizer, corpus, start: int, steps: int, sync_params: bool = False,
          shape: Shape = TINY, hashes: bool = True, forward_step=_forward_step):
    """``steps`` training steps from ``start``; per step: this rank's micro-batch losses
    (last pipeline stage), its wall time, the hash of its weights and of its
    TP-replicated weights."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    forward_backward = get_forward_backward_func()
    record = []
    for step in range(start, start + steps):
        start_s = time.perf_counter()
        x, y = corpus.batch("train", shape.batch, shape.seq, 0, step)
        per = shape.batch // dp
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        micro = [(x[i:i + shape.micro], y[i:i + shape.micro]) for i in range(0, per, shape.micro)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro),
                               model=[model], num_microbatches=len(micro), seq_length=shape.seq,
                               micro_batch_size=shape.micro, forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok, f"step {step} was skipped"
        if sync_params:  # overlap_param_gather defers the gather to the next forward
            model.start_param_sync(force_sync=True)
        record.append({"losses": [o["loss"].item() for o in out],
                       "time_s": time.perf_counter() - start_s})
        if hashes:
            record[-1].update(hash=weights_hash(model), replicated=weights_hash(model, True))
    return record


def weights_hash(model, replicated_only: bool = False) -> str:
    from commpress.frontends.parts.buckets import tensor_parallel_key

    h = hashlib.sha256()
    for name, p in model.module.named_parameters():
        if replicated_only and tensor_parallel_key(name, p):
            continue
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"dp": ps.get_data_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank()}


def run_policy(corpus, tp: int, pp: int, policy, steps: int, **layout) -> dict:
    """Train a fresh model ``steps`` steps with ``policy`` (None: stock Megatron)."""
    import commpress

    model, optimizer = build(tp, pp, **layout)
    commpress.reset_stats()
    comm = None if policy is None else commpress.megatron.compress(model, optimizer, policy)
    record = train(model, optimizer, corpus, 0, steps,
                   sync_params=layout.get("overlap_param_gather", False))
    stats = commpress.stats()
    buckets = [] if comm is None else sorted(comm.buckets)
    if comm is not None:
        comm.remove()
    return {"record": record, "stats": stats, "buckets": buckets}


def scenario(rank: int, world: int, tp: int, pp: int, jobs: list, ep: int = 1) -> dict:
    """Run ``jobs`` — ``(name, kind, kwargs)`` with kind ``train``, ``resume``,
    ``refusals`` or ``fp32_accumulation`` — in one process group of the given layout."""
    init_parallel(tp, pp, ep=ep)
    corpus = data()
    out = {"coords": coordinates()}
    for name, kind, kwargs in jobs:
        out[name] = JOBS[kind](corpus, tp, pp, **kwargs)
    return out


def killed_mid_step(rank: int, world: int, victim: int) -> dict:
    """dp2 with sdp4bit; the victim SIGKILLs itself after a forward pass of step 2."""
    import commpress
    from tests.reliability.killing import Killer

    init_parallel(1, 1)
    corpus = data()
    model, optimizer = build(1, 1)
    commpress.megatron.compress(model, optimizer, "sdp4bit")
    killer = Killer(rank, victim, at_step=2)
    step = 0

    def forward_step(data_iterator, model):
        out = _forward_step(data_iterator, model)
        killer.mid_step(step)
        return out

    def loop():
        nonlocal step
        for step in range(1000):
            train(model, optimizer, corpus, step, 1, hashes=False, forward_step=forward_step)

    return killer.survive(loop)


def compress_on_rank_0_only(rank: int, world: int, timeout_s: float) -> tuple[str, float]:
    """Rank 0 compresses, rank 1 never does (it waits in a barrier of the default group,
    which rank 0 joins once refused): rank 0's error and the seconds it took."""
    import time

    import torch.distributed as dist

    import commpress

    init_parallel(1, 1, timeout_minutes=timeout_s / 60)
    model, optimizer = build(1, 1)
    error, t0 = "", time.monotonic()
    if rank == 0:
        try:
            commpress.megatron.compress(model, optimizer, "sdp4bit")
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    dist.barrier()
    return error, seconds


# -- resume -------------------------------------------------------------------------------

def _optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])


def save(model, optimizer, comm) -> bytes:
    """This rank's checkpoint in memory: weights, fp32 master shards, Adam state, codecs."""
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(),
                "inner": [o.optimizer.state_dict() for o in _optimizers(optimizer)],
                "main": [[p.detach().clone() for g in o.optimizer.param_groups
                          for p in g["params"]] for o in _optimizers(optimizer)],
                "comm": None if comm is None else comm.state_dict()}, buffer)
    return buffer.getvalue()


@torch.no_grad()
def load(blob: bytes, model, optimizer, comm) -> None:
    state = torch.load(io.BytesIO(blob), weights_only=False)
    model.module.load_state_dict(state["model"])
    for o, inner, main in zip(_optimizers(optimizer), state["inner"], state["main"]):
        o.optimizer.load_state_dict(inner)
        params = [p for g in o.optimizer.param_groups for p in g["params"]]
        for p, saved in zip(params, main):
            p.copy_(saved)
    if comm is not None and state["comm"] is not None:
        comm.load_state_dict(state["comm"])


def resume(corpus, tp: int, pp: int, policy, steps: int, **layout) -> dict:
    """An uninterrupted run, a run saved at ``steps // 2`` and resumed in fresh objects,
    and the same resumed without the codec state."""
    import commpress

    half = steps // 2

    def fresh():
        model, optimizer = build(tp, pp, **layout)
        return model, optimizer, commpress.megatron.compress(model, optimizer, policy)

    model, optimizer, comm = fresh()
    whole = train(model, optimizer, corpus, 0, steps)
    comm.remove()
    model, optimizer, comm = fresh()
    first = train(model, optimizer, corpus, 0, half)
    blob = save(model, optimizer, comm)
    comm.remove()
    out = {"whole": whole, "first": first}
    for name, with_codecs in (("resumed", True), ("without_codec_state", False)):
        model, optimizer, comm = fresh()
        load(blob, model, optimizer, comm if with_codecs else None)
        out[name] = train(model, optimizer, corpus, half, steps - half)
        comm.remove()
    return out


# -- refusals and undo ---------------------------------------------------------------------

def refusals(corpus, tp: int, pp: int) -> dict:
    """What compress refuses, and that remove() gives Megatron its functions back."""
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.tensor_parallel import mappings

    import commpress

    out = {}
    originals = (pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func,
                 pgb._coalescing_manager, pgb.torch, mappings._reduce)
    model, optimizer = build(tp, pp)
    with commpress.megatron.compress(model, optimizer, "sdp4bit") as comm:
        out["installed"] = pgb.dist_reduce_scatter_func is not originals[0]
        try:
            commpress.megatron.compress(model, optimizer, "none")
        except ValueError as e:
            out["twice"] = str(e)
        assert comm.axes == ["dp"]
    out["restored"] = (pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func,
                       pgb._coalescing_manager, pgb.torch, mappings._reduce) == originals
    fp32_model, fp32_optimizer = _fp32_model()
    compress = commpress.megatron.compress
    for name, call in (
            ("fp32_qwd", lambda: compress(fp32_model, fp32_optimizer, "sdp4bit")),
            ("not_ddp", lambda: compress(model.module, optimizer, "sdp4bit")),
            ("bad_policy", lambda: compress(model, optimizer, "sdp5bit")),
            ("other_optimizer", lambda: compress(model, fp32_optimizer, "sdp4bit"))):
        out[name] = _refusal(call)
    # configurations Megatron builds only on CUDA, or only with MoE: the same model with
    # the field set, as Megatron would hold it
    for name, holder, field, value in (
            ("instances", model.ddp_config, "num_distributed_optimizer_instances", 2),
            ("fp32_accumulation", model.ddp_config, "reduce_scatter_with_fp32_accumulation",
             True),
            ("moe", model.config, "num_moe_experts", 4)):
        saved = getattr(holder, field)
        setattr(holder, field, value)
        out[name] = _refusal(lambda: compress(model, optimizer, "sdp4bit"))
        setattr(holder, field, saved)
    # exact weights on fp32 parameters are fine
    compress(fp32_model, fp32_optimizer, "tlqhs").remove()
    # data-parallel ranks that compress with other policies are told so at compress, every one
    import torch.distributed as dist

    mine = "sdp4bit" if dist.get_rank() % 2 == 0 else "hybrid"
    try:
        compress(model, optimizer, mine).remove()
        out["disagreeing"] = None
    except RuntimeError as e:
        out["disagreeing"] = f"{type(e).__name__}: {e}"
    return out


def _refusal(call) -> str | None:
    try:
        call().remove()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def scoped(corpus, tp: int, pp: int, steps: int, **layout) -> dict:
    """A second model trained while the first has a policy: stock Megatron's path and
    bits (it goes through the replaced functions to Megatron's originals)."""
    import commpress

    model, optimizer = build(tp, pp, **layout)
    comm = commpress.megatron.compress(model, optimizer, "sdp4bit")
    other, other_optimizer = build(tp, pp, **layout)
    commpress.reset_stats()
    record = train(other, other_optimizer, corpus, 0, steps,
                   sync_params=layout.get("overlap_param_gather", False))
    stats = commpress.stats()
    comm.remove()
    return {"record": record, "stats": stats}


def _fp32_model():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=256, max_sequence_length=SEQ)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    return model, get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [model])


def fp32_accumulation(corpus, tp: int, pp: int) -> str:
    """A model built with reduce_scatter_with_fp32_accumulation after compress re-binds the
    reduce-scatter; the next gradient sync must fail instead of passing uncompressed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import commpress

    model, optimizer = build(tp, pp)
    comm = commpress.megatron.compress(model, optimizer, "sdp4bit")
    fp32_model, _ = _fp32_model()
    DistributedDataParallel(fp32_model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True),
        fp32_model.module)
    try:
        train(model, optimizer, corpus, 0, 1)
    except RuntimeError as e:
        return str(e)
    finally:
        comm.remove()
    return "trained"



# -- elastic resume ------------------------------------------------------------------------

def elastic(corpus, tp: int, pp: int, policy, directory: str, load_tag, save_tag: str,
            start: int) -> dict:
    """From step ``start``: with ``load_tag`` (saved on another number of ranks), the
    weights loaded (Megatron's masters reloaded from them: its own optimizer state is
    dist_checkpointing's to reshard) and the codec state loaded two ways — as it is
    (refused) and elastic — then, as the control, applied without any codec state; each
    trains 2 steps. Saves the weights (rank 0) and every rank's codec state as
    ``save_tag``."""
    import logging
    import os

    import commpress

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    rank = dist.get_rank()

    def fresh(tag):
        model, optimizer = build(tp, pp)
        if tag is not None:
            model.module.load_state_dict(torch.load(os.path.join(directory, tag, "model.pt"),
                                                    weights_only=True))
            optimizer.reload_model_params()
        return model, optimizer, commpress.megatron.compress(model, optimizer, policy)

    out = {}
    model, optimizer, comm = fresh(load_tag)
    if load_tag is not None:
        saved = os.path.join(directory, load_tag, "comm-rank{}.pt")
        own = saved.format(rank) if os.path.exists(saved.format(rank)) else saved.format(0)
        try:
            comm.load_state_dict(torch.load(own, weights_only=True))
            out["strict"] = None
        except ValueError as e:
            out["strict"] = str(e)
        comm.load_state_dict(torch.load(saved.format(0), weights_only=True), elastic=True)
    out["elastic"] = train(model, optimizer, corpus, start, 2)
    if load_tag is not None:
        control, control_opt, control_comm = fresh(load_tag)
        out["control"] = train(control, control_opt, corpus, start, 2)
        control_comm.remove()
    os.makedirs(os.path.join(directory, save_tag), exist_ok=True)
    torch.save(comm.state_dict(), os.path.join(directory, save_tag, f"comm-rank{rank}.pt"))
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(directory, save_tag, "model.pt"))
    dist.barrier()
    comm.remove()
    out["logged"] = [m for m in records if "start fresh" in m]
    return out


def one_disagrees(corpus, tp: int, pp: int) -> str | None:
    """Rank 0 alone compresses with another policy → this rank's error, or None."""
    import torch.distributed as dist

    import commpress

    model, optimizer = build(tp, pp)
    mine = "hybrid" if dist.get_rank() == 0 else "sdp4bit"
    try:
        commpress.megatron.compress(model, optimizer, mine).remove()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return None


JOBS = {"train": run_policy, "resume": resume, "refusals": refusals, "scoped": scoped,
        "fp32_accumulation": fp32_accumulation, "elastic": elastic,
        "one_disagrees": one_disagrees}
