"""`commpress compare`: one run per policy, a table, plots and JSON."""

import json

import pytest

from commpress.cli import main


@pytest.mark.slow
def test_compare_cli_writes_table_plots_and_json(tmp_path, capsys):
    out, js = tmp_path / "cmp", tmp_path / "cmp.json"
    code = main(["compare", "--policies", "none,naive", "--model", "gpt-tiny", "--seq-len", "32",
                 "--steps", "2", "--batch-size", "4", "--nproc", "2", "--eval-batches", "1",
                 "--max-data-bytes", "200000", "--no-progress", "--out", str(out),
                 "--json", str(js)])
    assert code == 0
    text = capsys.readouterr().out
    assert "policy comparison" in text and "naive" in text
    result = json.load(open(js))["policies"]
    assert set(result) == {"none", "naive"}
    assert result["naive"]["bits_per_elem"]["dp.grad"] < 5 < result["none"]["bits_per_elem"][
        "dp.grad"]
    assert (out / "compare.png").stat().st_size > 10_000



def test_a_finished_run_from_before_a_field_existed_counts_with_the_fields_default(tmp_path):
    """A finished run's config.json written before ``outer_momentum`` existed ran the
    default: it is reused; one whose value differs from this comparison's is refused."""
    from commpress import InputError
    from commpress.train.compare import _finished_summary
    from commpress.train.config import TrainConfig

    run = dict(model="gpt-tiny", seq_len=32, steps=2, nproc=2, engine="ddp", outer="diloco",
               ranks_per_node=1)
    cfg = TrainConfig(**run)
    saved = cfg.resolved().to_dict()
    del saved["outer_momentum"]
    (tmp_path / "summary.json").write_text(json.dumps({"final_val_loss": 5.0}))
    (tmp_path / "config.json").write_text(json.dumps({"train": saved}))
    assert _finished_summary(str(tmp_path), cfg) == {"final_val_loss": 5.0}
    other = TrainConfig(**run, outer_momentum=0.5)
    with pytest.raises(InputError, match="finished with outer_momentum=0.9, this comparison "
                                         "has outer_momentum=0.5"):
        _finished_summary(str(tmp_path), other)
    (tmp_path / "config.json").write_text(json.dumps({"train": {**saved, "outer_lr": 0.5}}))
    with pytest.raises(InputError, match="finished with outer_lr=0.5"):
        _finished_summary(str(tmp_path), cfg)
