"""Numeric arguments of the public collectives: refused by name before anything is sent."""

import pytest
import torch

import commpress


@pytest.mark.parametrize("tag", [-1, 2**31, 1.5, True])
@pytest.mark.parametrize("call", [commpress.isend, commpress.irecv, commpress.send,
                                  commpress.recv])
def test_point_to_point_tags_fit_torch_distributed(call, tag):
    """A negative tag used to fail on the sending side only, so the receiver waited out
    the timeout and then blamed the sender; a tag past 2³¹ − 1 was a TypeError."""
    with pytest.raises(ValueError, match=rf"tag={tag!r} is not allowed; allowed: an integer in "
                                         r"\[0, 2147483647\]"):
        call(torch.ones(4), 1, "int8", tag=tag)


@pytest.mark.parametrize("ranks_per_node", [0, -2, 1.5, "2"])
def test_topology_ranks_per_node(ranks_per_node):
    with pytest.raises(ValueError, match=f"ranks_per_node={ranks_per_node!r} is not allowed"):
        commpress.Topology(ranks_per_node)


def test_error_feedback_is_memory_beside_the_codec():
    """The memory is not a codec: passing it as one, or wrapping a codec in it, is refused
    by name with the keyword to use."""
    with pytest.raises(ValueError, match=r"ErrorFeedback\(.*\) is not allowed.*memory="):
        commpress.ErrorFeedback(commpress.codec("int2"))
    with pytest.raises(ValueError, match=r"codec=ErrorFeedback.*is not allowed.*memory="):
        commpress.isend(torch.ones(4), 1, commpress.ErrorFeedback())
    with pytest.raises(ValueError, match=r"memory='int2' is not allowed; allowed: None or"):
        commpress.isend(torch.ones(4), 1, "int2", memory="int2")
