"""Parameters replicated across tensor-parallel ranks stay bitwise identical at every
step, for every preset (Megatron requires it; a shared quantization group would not)."""

import pytest

import commpress
from commpress.launch import spawn
from tests.train import workers

BASE = dict(model="gpt-tiny", steps=4, batch_size=8, seq_len=32, warmup=1, eval_every=0,
            eval_batches=1, max_data_bytes=200_000, progress=False, bucket_numel=20_000,
            ranks_per_node=2)


def _check(ranks, policies):
    for policy in policies:
        by_stage: dict[int, list] = {}
        for r in ranks:
            by_stage.setdefault(r[policy]["coords"][1], []).append(r[policy]["digests"])
        for stage, digests in by_stage.items():
            for step in range(len(digests[0])):
                # every rank of the stage (all tp and dp indices) holds the same replicas
                assert len({d[step] for d in digests}) == 1, (policy, stage, step)


@pytest.mark.slow
def test_dp2_tp2_every_preset():
    policies = commpress.list_presets()
    ranks = spawn(workers.replicated_digests, 4, (dict(BASE, dp=2, tp=2), policies),
                  ranks_per_node=2, timeout=600)
    _check(ranks, policies)


@pytest.mark.slow
def test_mixed_buckets_would_drift():
    # the same run with TP-sliced and TP-replicated parameters in one bucket: a shared
    # quantization group gives the replicas different decoded values
    ranks = spawn(workers.replicated_digests, 4,
                  (dict(BASE, dp=2, tp=2), ["sdp4bit"], _one_class), ranks_per_node=2,
                  timeout=300)
    with pytest.raises(AssertionError):
        _check(ranks, ["sdp4bit"])


def _one_class(name, p):
    return 0


@pytest.mark.slow
def test_dp2_tp2_pp2_every_preset():
    policies = commpress.list_presets()
    ranks = spawn(workers.replicated_digests, 8,
                  (dict(BASE, dp=2, tp=2, pp=2, ranks_per_node=4), policies),
                  ranks_per_node=4, timeout=1200)
    _check(ranks, policies)
