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

