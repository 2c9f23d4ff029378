"""Adapters inside other training engines: FSDP2/HSDP (``commpress.fsdp``), torchtitan,
Megatron-core, DeepSpeed, Lightning, the Hugging Face Trainer and torchft. Each applies a
policy at the engine's own plug point with ``compress(...)``, returns a handle with
``state_dict()``, ``load_state_dict()`` and ``remove()`` (Lightning's is its strategy),
and holds one :class:`~commpress.dp.DPBucket` per bucket. They import their engine, so
none is imported here: ``commpress.deepspeed`` and the others load on first use."""
