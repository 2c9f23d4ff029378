"""PowerSGD with quantized factors, as a DDP communication hook.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019; torch's ``powerSGD_hook``)
sends, for each gradient matrix ``M`` (n × m), two thin factors: ``P = M Q`` (n × r),
all-reduced and orthogonalized, then ``Q = Mᵀ P`` (m × r), all-reduced; the update is
``P Qᵀ`` and the rest, ``M − P Qᵀ``, is fed back into the next step. Torch's hook
all-reduces both factors as fp32 over the whole group, one DDP bucket at a time.

This hook changes how the factors travel, not what they are:

1. **Factors cross nodes as codes** (``factor_codec``, e.g. int8 or int4 with group
   scales): a two-level all-reduce sums them exactly inside the node and sends the
   node's sum once, quantized, to the other nodes. Each factor travels transposed,
   column after column, so one column's entries share a codec group: a weak direction
   is not rounded on the scale of a strong one (laid out row by row, int8 factors
   stalled at about 3× fp32's approximation error). ``Q`` is orthogonalized before
   ``P = M Q`` (the same span): the columns of ``Q`` as sent scale with the singular
   values, and int8 rounding of a weak one along a strong direction, multiplied by
   ``M``, took the weakest directions out of ``P``. Every rank decodes the same bytes,
   so ``P`` is orthogonalized identically everywhere and replicas stay identical.
2. **Vectors** (biases, norms; matrices too small to gain ``min_compression_rate``)
   ride in ``Q``'s all-reduce.
3. **Each memory keeps only what was not sent.** PowerSGD keeps ``M − P Q̂ᵀ`` on each
   rank: beside what the rank truncation dropped, that holds the rank's difference from
   the average inside the sent subspace (all of it for vectors), which no later step
   sends (the differences cancel in the average) and which never decays. Exact sums
   cancel it; node sums of codes do not: it sets their scale, and its rounding swamps
   the gradient for the rest of the run (a fixed difference grows it every step). Here
   a rank keeps ``M − P Q_rᵀ`` with its own ``Q_r = Mᵀ P`` before averaging (the same
   average), no memory for vectors, and the codes' rounding of ``Q`` and the vectors —
   what the weights add up over steps — in the codec's own error feedback, on the rank
   that rounds a node's sum (:class:`~commpress.codecs.ErrorFeedback`); ``P`` only
   spans the subspace, and its rounding is not remembered.
4. **The hook's own buckets** (:class:`~commpress.frontends.ddp.DDPHookState`: a
   fixed layout by parameter name, one communication thread) run during backward and
   make the state checkpointable; torch's PowerSGD must finish each DDP bucket before
   the next on Gloo.

Rejected: quantizing ``M`` itself before the low-rank step (the codes' error would
be projected and mostly lost, and nothing would shrink on the wire).

A step whose decoded result is not finite is passed on as it is (the optimizer skips
it) and leaves the memory and the warm-start ``Q`` untouched, so one overflow does not
poison later steps; the decision depends only on decoded values, the same everywhere.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.
import hashlib
import itertools
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from commpress.codecs import ErrorFeedback
from commpress.codecs import codec as build_codec
from commpress.codecs.error_feedback import coder_state, load_coder_state
from commpress.collectives import Topology, hierarchical_all_reduce
from commpress.collectives.agreement import agree
from commpress.collectives.call import is_exact
from commpress.collectives.handle import completed
from commpress.dp import DPBucket
from commpress.frontends.ddp import BUCKET_NUMEL, DDPHookState, compressed_allreduce_hook
from commpress.validate import MAX_SEED, InputError, check_bool, check_float, check_int

LABEL = "dp.grad.lowrank"


@dataclass(frozen=True)
class LowRankConfig:
    """Hyperparameters of :func:`lowrank_hook` (checkpoints must match them)."""

    rank: int = 4
    factor_codec: str = "int8"
    start_iter: int = 2  # exact all-reduce steps first, as the trainer sets torch's PowerSGD
    min_compression_rate: float = 2.0
    seed: int = 0
    alternate: bool = False  # ACP-SGD: one factor per step, one all-reduce instead of two

    def __post_init__(self) -> None:
        check_int("lowrank_hook: rank", self.rank, ge=1)
        check_int("lowrank_hook: start_iter", self.start_iter, ge=0)
        check_float("lowrank_hook: min_compression_rate", self.min_compression_rate, ge=1)
        check_int("lowrank_hook: seed", self.seed, ge=0, le=MAX_SEED)
        check_bool("lowrank_hook: alternate", self.alternate)
        if not isinstance(self.factor_codec, str):
            raise InputError(f"lowrank_hook: factor_codec={self.factor_codec!r} is not "
                             "allowed; allowed: a codec spec such as 'int8'")
        build_codec(self.factor_codec)  # a bad spec fails here, naming the allowed ones


@dataclass(frozen=True)
class _Matrix:
    offset: int
    n: int
    m: int
    r: int


class LowRankReducer:
    """One hook bucket's PowerSGD: which parameters are matrices, their warm-start ``Q``
    and the error-feedback memory. Used by :class:`DDPHookState` where a
    :class:`~commpress.dp.grad_path.GradPath` would be."""

    def __init__(self, shapes: list[torch.Size], offsets: list[int], numel: int,
                 config: LowRankConfig, topology: Topology, bucket_index: int) -> None:
        # hyperparameters
        self.config = config
        self.topology = topology
        self.exact = build_codec("none")
        self.codec = build_codec(config.factor_codec)
        # for the factor that multiplies the update, and the vectors (module docstring)
        self.codec_ef = build_codec(config.factor_codec)
        self.memory = None if is_exact(self.codec_ef) else ErrorFeedback()
        self.matrices: list[_Matrix] = []
        self.vector_slices: list[tuple[int, int]] = []  # (offset, numel)
        for shape, offset in zip(shapes, offsets):
            size = shape.numel()
            if len(shape) >= 2:
                n, m = shape[0], size // shape[0]
                r = min(config.rank, n, m)
                if n * m >= config.min_compression_rate * r * (n + m):
                    self.matrices.append(_Matrix(offset, n, m, r))
                    continue
            self.vector_slices.append((offset, size))
        self.numel = numel
        # internal state
        self.iter = 0
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + bucket_index)
        self.qs = [torch.randn(x.m, x.r, generator=g) for x in self.matrices]
        self.ps = [torch.zeros(x.n, x.r) for x in self.matrices]  # alternate: last P sent
        self.error: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self._agreed = False  # whether the ranks were checked to hold the same factors

    def _check_same_factors(self, group: dist.ProcessGroup | None) -> None:
        """Refuse, on every rank, ranks that start from different factors or steps (a
        per-rank ``seed``, one rank resumed from another step's state): ``alternate``
        multiplies by this rank's own ``Q`` or ``P`` unaveraged, so replicas would drift
        apart without an error. Once after construction and after each load: from then on
        every factor a rank keeps is an average, the same everywhere."""
        digest = hashlib.blake2b(digest_size=16)
        for t in (*self.qs, *self.ps):
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        agree(group, "lowrank_hook.state", label=LABEL, seed=self.config.seed,
              iter=self.iter, factors=digest.hexdigest())
        self._agreed = True

    def _sends_p(self) -> bool:
        """Alternate scheme: whether this step sends ``P`` (else ``Q``)."""
        return (self.iter - self.config.start_iter) % 2 == 0

    def wire_elements(self) -> list[int]:
        """Elements of each all-reduce of the next compressed step: PowerSGD ``[P, Q and
        vectors]``; alternate ``[P and vectors]`` or ``[Q and vectors]``."""
        vectors = sum(k for _, k in self.vector_slices)
        n_p = sum(x.n * x.r for x in self.matrices)
        n_q = sum(x.m * x.r for x in self.matrices)
        if not self.config.alternate:
            return [n_p, n_q + vectors]
        return [(n_p if self._sends_p() else n_q) + vectors]

    def _reduce(self, flat: torch.Tensor, codec, group: dist.ProcessGroup | None,
                label: str = LABEL, memory: ErrorFeedback | None = None) -> None:
        hierarchical_all_reduce(flat, intra=self.exact, inter=codec, topology=self.topology,
                                group=group, op="avg", label=label, inter_memory=memory)

    def _send(self, views: list[torch.Tensor], bases: list[torch.Tensor], left: bool,
              vectors: torch.Tensor | None, group, codec,
              memory: ErrorFeedback | None = None
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Average ``M B`` (``Mᵀ B`` when ``left``) of every matrix, with ``vectors``
        appended, across the group; returns the averaged factors, then the vectors, and
        this rank's own factors before averaging."""
        sizes = [(x.m if left else x.n) * x.r for x in self.matrices]
        extra = 0 if vectors is None else vectors.numel()
        flat = torch.empty(sum(sizes) + extra, device=self.device)
        parts = list(flat.split(sizes + [extra]))
        # transposed, column after column: one column per codec group (module docstring)
        for mv, b, out in zip(views, bases, parts):
            torch.mm(b.t(), mv if left else mv.t(), out=out.view(b.shape[1], -1))
        if vectors is not None:
            parts[-1].copy_(vectors)
        factors = [out.view(b.shape[1], -1).t() for out, b in zip(parts, bases)]
        local = [f.clone() for f in factors]
        # P and Q each their own label: the codec's memory is kept per label
        self._reduce(flat, codec, group, f"{LABEL}.{'q' if left else 'p'}", memory)
        return factors + parts[len(bases):], local

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "avg",
                   async_op: bool = False):
        """Average ``tensor`` (the hook bucket) in place. Done when it returns, also with
        ``async_op=True`` (each factor's sum feeds the next step): a completed handle then."""
        assert op == "avg", op
        if not self._agreed:
            self._check_same_factors(group)
        if self.iter < self.config.start_iter:
            self._reduce(tensor, self.exact, group)
            self.iter += 1
            return completed(tensor) if async_op else tensor
        # Step 1: add the memory: M = G + E
        if self.error is None:
            self.error = torch.zeros_like(tensor, dtype=torch.float32)
        if self.device != tensor.device:  # the factors live where the gradients do
            self.device = tensor.device
            self.qs = [q.to(tensor.device) for q in self.qs]
            self.ps = [p.to(tensor.device) for p in self.ps]
        compensated = tensor.float() + self.error
        views = [compensated[x.offset: x.offset + x.n * x.m].view(x.n, x.m)
                 for x in self.matrices]
        vectors = torch.cat([compensated[o: o + k] for o, k in self.vector_slices]
                            or [compensated[:0]])
        left = True  # whether the last factor sent was Q (else P)
        if not self.config.alternate:
            # Step 2-3: P = M orth(Q), averaged (orth: module docstring); Step 4:
            # orthogonalize P; Step 5: Q = Mᵀ P, averaged with the vectors; the update
            # is P Qᵀ. P only spans: its codes' rounding is not remembered
            qs = [torch.linalg.qr(q).Q for q in self.qs]
            ps = self._send(views, qs, False, None, group, self.codec)[0][:-1]
            ps = [torch.linalg.qr(p).Q for p in ps]
            (*qs, vectors), local = self._send(views, ps, True, vectors, group,
                                               self.codec_ef, self.memory)
        elif self._sends_p():
            # ACP-SGD (Zhang et al., ICDCS 2023): one factor per step, alternating;
            # P = M orth(Q), averaged with the vectors; the update is P orth(Q)ᵀ
            qs = [torch.linalg.qr(q).Q for q in self.qs]
            (*ps, vectors), local = self._send(views, qs, False, vectors, group,
                                               self.codec_ef, self.memory)
            left = False
        else:
            ps = [torch.linalg.qr(p).Q for p in self.ps]
            (*qs, vectors), local = self._send(views, ps, True, vectors, group,
                                               self.codec_ef, self.memory)
        # Step 6: the update, P Qᵀ for matrices and the averaged vectors
        result = torch.empty_like(compensated)
        for x, p, q in zip(self.matrices, ps, qs):
            torch.mm(p, q.t(), out=result[x.offset: x.offset + x.n * x.m].view(x.n, x.m))
        parts = vectors.split([k for _, k in self.vector_slices])
        for (offset, k), part in zip(self.vector_slices, parts):
            result[offset: offset + k] = part
        # Step 7: keep what was not sent of this rank's own M (module docstring): the
        # last factor sent as this rank computed it; a non-finite result leaves the
        # state as it was
        if update_is_finite(result, [x.r for x in self.matrices], ps, qs, vectors):
            self.error.zero_()
            mine = zip(ps, local) if left else zip(local, qs)
            for x, (p, q), mv in zip(self.matrices, mine, views):
                out = self.error[x.offset: x.offset + x.n * x.m].view(x.n, x.m)
                torch.addmm(mv, p, q.t(), alpha=-1, out=out)
            self.ps, self.qs = [p.clone() for p in ps], [q.clone() for q in qs]
        tensor.copy_(result)
        self.iter += 1
        return completed(tensor) if async_op else tensor

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "qs": [q.clone() for q in self.qs],
                "ps": [p.clone() for p in self.ps],
                "error": None if self.error is None else self.error.clone(),
                "codec": self.codec.state_dict(),
                "codec_ef": coder_state(self.codec_ef, self.memory)}

    def load_state_dict(self, state: dict[str, Any], memory: bool = True) -> None:
        """Restore the factors and step (every rank holds them alike) and, unless
        ``memory=False`` (an elastic resume), this rank's memory and codec state."""
        shapes = [tuple(q.shape) for q in self.qs]
        theirs = [tuple(q.shape) for q in state["qs"]]
        if theirs != shapes:
            raise InputError(f"low-rank hook state has factors {theirs}; this bucket has "
                             f"{shapes}: resume with the same model and rank")
        self.iter = state["iter"]
        self.qs = [q.to(self.device, copy=True) for q in state["qs"]]
        self.ps = [p.to(self.device, copy=True) for p in state["ps"]]
        self._agreed = False
        if not memory:
            return
        self.error = None if state["error"] is None else state["error"].to(self.device,
                                                                             copy=True)
        self.codec.load_state_dict(state["codec"])
        load_coder_state(self.codec_ef, self.memory, state["codec_ef"])


FLOAT32_MAX = torch.finfo(torch.float32).max


def update_is_finite(result: torch.Tensor, ranks: list[int], ps: list[torch.Tensor],
                     qs: list[torch.Tensor], vectors: torch.Tensor) -> bool:
    """Whether ``result`` — each matrix's ``P Qᵀ`` (inner dimension ``ranks[i]``) and the
    vectors — is finite, decided from the small factors where they can: a non-finite
    factor makes its product non-finite, and finite factors with ``r · max|P| · max|Q|``
    under half the float32 maximum bound every product entry below it. Only in between
    is the whole result scanned; two host synchronizations otherwise, not one per
    factor."""
    small = (*ps, *qs, vectors)
    if not bool(torch.stack([torch.isfinite(t).all() for t in small]).all()):
        return False
    if not ranks:
        return True
    bounds = torch.stack([r * p.abs().amax().double() * q.abs().amax().double()
                          for r, p, q in zip(ranks, ps, qs)])
    if bool(bounds.max() < FLOAT32_MAX / 2):
        return True
    return bool(torch.isfinite(result).all())


class LowRankHookState(DDPHookState):
    """:class:`DDPHookState` whose buckets are reduced by :class:`LowRankReducer`."""

    def __init__(self, model: nn.Module, config: LowRankConfig,
                 group: dist.ProcessGroup | None = None, topology: Topology | None = None,
                 overlap: bool = True, bucket_numel: int = BUCKET_NUMEL) -> None:
        self.config = config
        self._shapes = {n: p.shape for n, p in getattr(model, "module", model).named_parameters()}
        super().__init__(model, "none", group, topology, label=LABEL, overlap=overlap,
                         bucket_numel=bucket_numel)

    def _make_dp(self, index: int, names: list[str]) -> DPBucket:
        shapes = [self._shapes[n] for n in names]
        offsets = list(itertools.accumulate((s.numel() for s in shapes[:-1]), initial=0))
        return DPBucket(self.policy, self.topology, LABEL, reducer=partial(
            LowRankReducer, shapes, offsets, sum(s.numel() for s in shapes), self.config,
            self.topology, index))

    def _make_hook_group(self) -> dist.ProcessGroup:
        # node groups are made now, with the hook group, not on the communication thread
        group = super()._make_hook_group()
        self.topology.resolve(group)
        return group

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "lowrank": asdict(self.config)}

    def wire_elements(self) -> int:
        """Elements all-reduced in the next compressed step, over every bucket."""
        return sum(sum(hb.dp.grad.wire_elements()) for hb in self.buckets)


def lowrank_hook(model: nn.Module, rank: int = 4, factor_codec: str = "int8",
                 start_iter: int = 2, min_compression_rate: float = 2.0, seed: int = 0,
                 alternate: bool = False, group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None, overlap: bool = True,
                 bucket_numel: int = BUCKET_NUMEL):
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``: PowerSGD of
    rank ``rank`` whose factors cross nodes as ``factor_codec`` codes.

    Sends per compressed step, per node across nodes, ``2 · (nodes − 1) / nodes`` times
    the codec's wire size of ``Σ r (n + m)`` factor elements plus the vector elements
    (``alternate``: ``Σ r n`` and ``Σ r m`` on alternate steps, plus the vectors each step)
    (int8 with group-128 fp32 scales: 8.25 bits each); the first ``start_iter`` steps are
    exact all-reduces.

    Args:
        model: the DDP module (or the module it wraps).
        rank: PowerSGD's matrix approximation rank.
        factor_codec: codec spec of the factors across nodes ("none" sends fp32).
        start_iter: exact steps before the low-rank ones.
        min_compression_rate: a matrix is approximated only if it shrinks this much.
        seed: seed of the initial ``Q``: the same on every rank (checked at the first step).
        alternate: send ``P`` and ``Q`` on alternate steps (ACP-SGD): one all-reduce per
            step and half the bytes, for a projection on one side at a time.
        group, topology, overlap, bucket_numel: as in :func:`commpress.ddp_hook`.

    Example::

        model = DDP(model)
        model.register_comm_hook(*lowrank_hook(model, rank=4, factor_codec="int8"))
    """
    config = LowRankConfig(rank, factor_codec, start_iter, min_compression_rate, seed, alternate)
    state = LowRankHookState(model, config, group, topology, overlap, bucket_numel)
    return state, compressed_allreduce_hook
