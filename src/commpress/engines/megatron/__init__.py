"""Megatron-core: ``compress``, one call, applies a commpress policy to a model and its optimizer.

``commpress.megatron.compress(model, optimizer, "sdp4bit")`` compresses what the policy
names, at the places Megatron-core itself communicates:

* ``dp`` — the gradient buckets' reduce-scatter (distributed optimizer; TLq-HS when
  ``dp.grad`` names ``intra``/``inter`` codecs) or all-reduce (plain DDP), and the
  distributed optimizer's weight all-gather (qWD when ``dp.param`` has ``delta``), with
  Megatron's bucketing, overlap, scaling and averaging as they are
  (:mod:`.data_parallel`);
* ``tp`` — activations' all-reduces and, with sequence parallelism, all-gathers and
  reduce-scatters (``tp.act``), and their gradients' (``tp.act_grad``)
  (:mod:`.model_parallel`);
* ``pp`` — activations sent to the next stage (``pp.act``) and gradients to the
  previous one (``pp.act_grad``);
* ``ep`` — a mixture of experts' token all-to-alls (``MoEAlltoAllTokenDispatcher``:
  ``ep.dispatch``, ``ep.combine`` and their gradients, :mod:`.expert_parallel`) where the
  policy names ``ep`` rules; the experts' gradient buckets reduce over their own
  data-parallel group through ``dp`` like the dense ones.

Megatron's module-level communication functions are replaced while a policy is
applied (:mod:`.seams`) and dispatch on the model's own buckets and groups; the
handle's ``remove()`` gives them back. We rejected wrapping Megatron's classes
(``DistributedDataParallel``, ``ColumnParallelLinear``): their communication is spread
over methods that would have to be copied, and a copy drifts from the engine's next
release, while the functions replaced here are the ones Megatron itself calls.

Not covered, and exact: the vocabulary-parallel cross-entropy's reductions (three
``(sequence × batch)`` float all-reduces on the TP group), the tied word-embedding
gradients' all-reduce between the first and last pipeline stages, the layer-norm
gradients' all-reduce under sequence parallelism, and scalars (gradient norm, loss).
Refused: Megatron FSDP, MoE dispatchers other than ``alltoall`` (``allgather``, ``flex``)
and expert tensor parallelism above 1, fp8 parameters, several distributed-
optimizer instances, ``reduce_scatter_with_fp32_accumulation``, Transformer Engine
layers or ``tp_comm_overlap`` with tensor parallelism, unbatched or ring pipeline
transfers, and a lossy ``dp.param`` on fp32 parameters (the distributed optimizer
updates those in place: they are its master weights).
"""

try:
    import megatron.core  # noqa: F401
except ImportError as e:  # pragma: no cover - the engine is an optional dependency
    raise ImportError("commpress.megatron needs Megatron-core: pip install megatron-core "
                      "(the tested version is pinned in requirements-engines.txt)") from e

from commpress.engines.megatron.compression import MegatronCompression, compress

__all__ = ["MegatronCompression", "compress"]
