import pytest
import torch

from commpress.train.data import TextData, load_tokens


def test_default_corpus_is_real_text_and_deterministic():
    a, b = load_tokens(max_bytes=100_000), load_tokens(max_bytes=100_000)
    assert torch.equal(a, b) and a.numel() == 100_000
    text = bytes(a[:2000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text
    data = TextData(a)
    x1, y1 = data.batch("train", 4, 16, seed=1, step=3)
    x2, y2 = data.batch("train", 4, 16, seed=1, step=3)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(data.batch("train", 4, 16, seed=1, step=4)[0], x1)
    assert 2.0 < data.unigram_entropy() < 5.5


def test_text_folder_and_bin(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "b.md").write_text("more text " * 100)
    assert load_tokens(str(tmp_path)).numel() == 1200 + 1000
    import numpy as np

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "toks.bin")
    t = load_tokens(str(tmp_path / "toks.bin"))
    assert t.tolist()[:3] == [0, 1, 2] and t.numel() == 1000


def test_bad_data_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_tokens(str(tmp_path / "empty.txt"))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_tokens(str(tmp_path / "d"))
    data = TextData(torch.arange(100) % 7)
    with pytest.raises(ValueError, match="sequence length 64 is longer than the data allows"):
        data.batch("train", 2, 64, 0, 0)
