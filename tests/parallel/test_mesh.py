import pytest

from commpress.parallel.mesh import MeshShape, _groups
from commpress.parallel.pipeline import stage_layers


def test_megatron_order_tp_innermost():
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert [shape.coords(r) for r in range(8)][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0),
                                                        (0, 1, 1)]
    assert _groups(shape, "tp")[0] == [0, 1]
    assert _groups(shape, "pp")[0] == [0, 2]
    assert _groups(shape, "dp")[0] == [0, 4]
    for r in range(8):
        assert shape.rank_of(*shape.coords(r)) == r


def test_world_mismatch_is_named():
    with pytest.raises(ValueError, match="world size 6 is not dp × tp × pp = 2 × 2 × 1"):
        MeshShape(2, 2, 1).check_world(6)


def test_stage_layers_balanced():
    assert stage_layers(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    with pytest.raises(ValueError, match="pp=5 is larger than n_layer=4"):
        stage_layers(4, 5)
