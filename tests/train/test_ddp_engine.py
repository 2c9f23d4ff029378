"""The trainer's DDP engine with torch's hooks and commpress's hook."""

import pytest

from commpress.train.config import TrainConfig
from commpress.train.loop import train

TINY = dict(model="gpt-tiny", steps=4, batch_size=8, seq_len=32, eval_every=0, eval_batches=1,
            progress=False, max_data_bytes=200_000, engine="ddp", nproc=2)


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "powersgd:2", "commpress"])
def test_ddp_hooks_train(tmp_path, hook):
    s = train(TrainConfig(ddp_hook=hook, policy="sdp4bit", out=str(tmp_path), **TINY))
    assert s["final_val_loss"] < 5.6  # below the uniform-byte loss, ln 256 = 5.55
    if hook in ("allreduce", "fp16", "commpress"):
        assert sum(s["wire_bytes"].values()) > 0


def test_ddp_engine_refuses_tp():
    with pytest.raises(ValueError, match="engine=ddp runs data parallelism only"):
        TrainConfig(engine="ddp", tp=2)
    with pytest.raises(ValueError, match="ddp_hook='powersgd' is not allowed"):
        TrainConfig(ddp_hook="powersgd")
