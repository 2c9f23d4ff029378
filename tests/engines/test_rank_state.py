"""Each rank's state file beside an engine's checkpoint, on two real Gloo ranks: written
whole, verified on load, and refused on every rank together when any rank's file is
missing, truncated, flipped, another rank's or not a file at all."""

import os

import torch

import commpress
from commpress.launch import spawn
from commpress.validate import InputError


def _damage(path, how, rank, directory):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 7)
    elif how == "flipped":
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "missing":
        os.remove(path)
    elif how == "swapped":
        os.replace(path, os.path.join(directory, "spare.pt"))
        os.replace(os.path.join(directory, "rank0.pt"), path)
        os.replace(os.path.join(directory, "spare.pt"), os.path.join(directory, "rank0.pt"))
    elif how == "dev_zero":
        os.remove(path)
        os.symlink("/dev/zero", path)
    elif how == "not_ours":
        torch.save({"format": "something else"}, path)


def save_then_load(rank, world, directory, cases):
    """For each case: both ranks save; rank 1's file is damaged as the case says (None:
    left alone); both load. Returns, per case, whether each rank loaded what it saved, or
    the error it raised."""
    import torch.distributed as dist

    out = {}
    for how in cases:
        where = os.path.join(directory, str(how))
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, f"rank{rank}.pt")
        state = {"format": "x", "memory": torch.arange(1000.0) * (rank + 1), "calls": 7 + rank}
        commpress.save_rank_state(state, path)  # the public names, the world's group
        dist.barrier()
        if rank == 1 and how is not None:
            _damage(path, how, rank, where)
        dist.barrier()
        try:
            loaded = commpress.load_rank_state(path)
        except InputError as e:
            out[str(how)] = {"error": str(e)}
            continue
        out[str(how)] = {"equal": torch.equal(loaded["memory"], state["memory"])
                         and loaded["calls"] == state["calls"], "error": None,
                         "files": sorted(os.listdir(where))}
    return out


NEEDLES = {
    "truncated": "is truncated or corrupted",
    "flipped": "its SHA-256 does not match",
    "missing": "is missing",
    "swapped": "was written by rank 1 of 2; this is rank 0 of 2",  # both ranks' files
    "dev_zero": "is a character device",
    "not_ours": "is not a commpress rank-state file",
}


def test_a_bad_file_on_one_rank_is_refused_on_every_rank_and_a_good_one_loads(tmp_path):
    ranks = spawn(save_then_load, 2, (str(tmp_path), [None, *NEEDLES]), pg_timeout_s=30,
                  timeout=120)
    for how, needle in NEEDLES.items():
        for rank, r in enumerate(ranks):
            error = r[how]["error"]
            assert error is not None and needle in error, (how, rank, r[how])
            if how == "swapped":  # every rank refuses its file; all raise the first one's
                assert "rank0.pt" in error and "(ranks [0, 1] cannot resume)" in error
            else:
                assert "rank1.pt" in error
                assert rank == 1 or "[reported by rank 1]" in error
    for r in ranks:  # left alone: each rank loads what it saved, no temporary file left
        assert r["None"]["equal"] and r["None"]["files"] == ["rank0.pt", "rank1.pt"]


def test_one_process_without_torch_distributed_and_headers_that_break_parsing(tmp_path):
    """A single-process loop saves and loads without a process group; a header that makes
    the parser itself fail (``Infinity`` bytes, nesting past the recursion limit) is
    refused as bad input, never an exception that would leave the other ranks waiting."""
    import pytest

    path = str(tmp_path / "state.pt")
    commpress.save_rank_state({"calls": 3, "memory": torch.ones(4)}, path)
    assert commpress.load_rank_state(path)["calls"] == 3
    for header in (b'{"bytes": Infinity, "sha256": "0"}', b"[" * 3000):
        with open(path, "wb") as f:
            f.write(b"commpress.rank-state/1 " + header + b"\n")
        with pytest.raises(InputError, match="state.pt"):
            commpress.load_rank_state(path)


def elastic_resume(rank, world, directory, phase):
    """``phase="save"``: each rank's state. ``"load"``: the state each rank resumes from,
    strictly and elastically; elastically from a folder with no state too; what was said."""
    import logging

    from commpress.engines import rank_state

    if phase == "save":
        rank_state.save_in({"saved by": rank}, directory, "test")
        assert rank_state.file_of(directory) == os.path.join(directory, f"commpress-rank{rank}.pt")
        return None
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("commpress").addHandler(handler)
    out = {}
    try:
        out["strict"] = rank_state.resume_from(directory, "test", "save it", False,
                                               "OPTION=True")
    except InputError as e:
        out["strict"] = str(e)
    out["elastic"] = rank_state.resume_from(directory, "test", "save it", True, "OPTION=True")
    out["none saved"] = rank_state.resume_from(os.path.join(directory, "no"), "test",
                                               "save it", True, "OPTION=True")
    out["said"] = records
    return out


def test_an_elastic_resume_reads_rank_0s_file_only_when_the_world_changed(tmp_path):
    """Saved on 2 ranks: resumed on 3, strictly every rank refuses (rank 2 has no file,
    the others' are of another world) naming the option; elastically every rank takes rank
    0's state. Resumed on 2 elastically, each rank its own. No state at all: None, said
    once on rank 0."""
    spawn(elastic_resume, 2, (str(tmp_path), "save"), pg_timeout_s=30, timeout=120)
    three = spawn(elastic_resume, 3, (str(tmp_path), "load"), pg_timeout_s=30, timeout=120)
    for r in three:
        assert "rank0.pt' was written by rank 0 of 2; this is rank 0 of 3" in r["strict"]
        assert "on another number of ranks: OPTION=True" in r["strict"]
        assert "(ranks [0, 1, 2] cannot resume)" in r["strict"]
        assert r["elastic"] == {"saved by": 0}
        assert r["none saved"] is None
    assert len(three[0]["said"]) == 1 and "no commpress state beside" in three[0]["said"][0]
    assert three[1]["said"] == three[2]["said"] == []
    two = spawn(elastic_resume, 2, (str(tmp_path), "load"), pg_timeout_s=30, timeout=120)
    assert [r["elastic"] for r in two] == [{"saved by": 0}, {"saved by": 1}]
    assert [r["strict"] for r in two] == [{"saved by": 0}, {"saved by": 1}]
