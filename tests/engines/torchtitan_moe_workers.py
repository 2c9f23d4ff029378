"""Per-rank functions for the torchtitan mixture-of-experts tests (module level:
picklable): a tiny Qwen3-MoE (2 layers, 8 experts, top-2, SDPA attention: FlexAttention
has no CPU backward) with torchtitan's own expert parallelism over every rank."""

import hashlib

import torch
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as parallel_dims
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

import commpress

DIM, HEAD_DIM, VOCAB = 64, 16, 256


def qwen3_moe(world: int, seed: int = 0):
    """The model with torchtitan's EP over ``world`` ranks, initialized from ``seed`` alike on
    every rank (each keeps its slice of the experts)."""
    # a CPU build of torch makes torchtitan's device type "cuda" (tools.utils); its meshes
    # are built for that type, so it is told the machine's
    parallel_dims.device_type = "cpu"
    # torchtitan's trainer picks this backend: the dispatcher then calls all_to_all_single
    set_spmd_backend("partial_dtensor")
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_LINEAR_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=32,
            num_experts=8, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=128, theta=1e6)))
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    model.parallelize(ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world,
                                   world_size=world, spmd_backend="partial_dtensor"))
    return model


def _hash(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _steps(model, rank, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, VOCAB, (2, 16), generator=g)
        y = torch.randint(0, VOCAB, (2, 16), generator=g)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def moe_runs(rank, world, policies, steps):
    """Each policy (None: stock) on the same model and data → its losses, a hash of this
    rank's weights, the ep stats and the handle's type (by the policy's name), and the
    ep stats of one more step after ``remove()``."""
    out = {}
    for policy in policies:
        model = qwen3_moe(world)
        commpress.reset_stats()
        comm = None if policy is None else commpress.torchtitan.compress(model, policy)
        losses = _steps(model, rank, steps)
        stats = {k: v for k, v in commpress.stats().items() if k.startswith("ep.")}
        key = policy["name"] if isinstance(policy, dict) else policy
        out[key] = {"losses": losses, "hash": _hash(model), "stats": stats,
                       "handle": type(comm).__name__, "state": None if comm is None
                       else comm.state_dict()}
        if comm is not None:
            comm.remove()
            commpress.reset_stats()
            _steps(model, rank, 1)
            out[key]["stats_after_remove"] = {
                k: v for k, v in commpress.stats().items() if k.startswith("ep.")}
    return out


def refused(rank, world, policy):
    model = qwen3_moe(world)
    try:
        commpress.torchtitan.compress(model, policy)
    except Exception as e:  # noqa: BLE001 - the test reads the error's type and text
        return f"{type(e).__name__}: {e}"
    return None
