"""``commpress bench collectives``: an nccl-tests style table beside torch's own."""

import json

import pytest

from commpress.cli import main


def test_rows_for_every_collective_codec_and_size(tmp_path, capsys):
    path = tmp_path / "rows.json"
    code = main(["bench", "collectives", "--nproc", "2", "--sizes", "2048,4096", "--codecs",
                 "int8;none", "--iters", "2", "--device", "cpu", "--json", str(path)])
    assert code == 0
    rows = json.load(open(path))
    # 2 sizes × 3 collectives × (torch + 2 codecs)
    assert len(rows) == 18
    for r in rows:
        size = 2048 * 4 if r["size_bytes"] == 8192 else 4096 * 4
        assert r["size_bytes"] == size
        assert r["algbw_GBps"] == pytest.approx(size / r["time_us"] / 1e3)
        factor = 1.0 if r["collective"] == "all_reduce" else 0.5  # 2(n-1)/n, (n-1)/n at n=2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
        expected_bits = {"int8": 8.25, "none": 32.0, "torch": 32.0}[r["codec"]]
        assert r["bits_per_elem"] == pytest.approx(expected_bits)
        if r["codec"] == "int8":
            assert r["encode_us"] > 0 and r["decode_us"] > 0
    assert "busbw" in capsys.readouterr().out


def test_bad_input_is_refused_before_spawning(capsys):
    assert main(["bench", "collectives", "--codecs", "int4:grup=3"]) == 2
    assert "has no option 'grup'" in capsys.readouterr().err
    assert main(["bench", "collectives", "--sizes", "0"]) == 2
