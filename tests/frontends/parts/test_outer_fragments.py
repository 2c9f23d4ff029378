"""DiLoCo's fragments follow the trained parameters by name: which change is seen, and
how the fragments are re-formed (one process: the agreement and broadcast around it are
DiLoCo's, tested across ranks in test_diloco)."""

import torch
import torch.nn as nn

from commpress.collectives import Topology
from commpress.frontends.diloco import outer_policy
from commpress.frontends.parts.outer_fragments import (
    Fragment,
    apply_change,
    change,
    describe,
    named_parameters,
    orphans,
    split,
    trained,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))


def _fragments(model, count=2):
    policy = outer_policy("diloco-int4")
    return [Fragment(i, part, policy, Topology(1), "outer.grad")
            for i, part in enumerate(split(trained(model), count))]


def test_the_same_set_is_no_change_and_a_replaced_tensor_is_found_by_name():
    model = _model()
    fragments = _fragments(model)
    assert not change(fragments, trained(model))
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert not change(fragments, trained(model))  # new tensors, same names and shapes
    local = fragments[0].local(named_parameters(model))
    assert torch.equal(local, fragments[0].global_)


def test_a_frozen_parameter_goes_back_to_its_global_value_and_leaves_its_fragment():
    model = _model()
    fragments = _fragments(model)
    first = fragments[0]
    agreed = first.global_of("0.weight").clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # trained locally since the last sync
    model[0].weight.requires_grad_(False)
    seen = change(fragments, trained(model))
    assert seen.left == ["0.weight"] and seen.joined == []
    first.momentum.fill_(0.5)
    touched = apply_change(fragments, seen, named_parameters(model))
    assert touched == [0]
    assert torch.equal(model[0].weight.reshape(-1), agreed)  # the value every site agreed
    assert "0.weight" not in first.names
    assert first.global_.numel() == sum(first.numels)
    assert bool((first.momentum == 0.5).all())  # the others keep their momentum


def test_joining_parameters_go_to_the_smallest_fragment_with_their_own_values():
    model = _model()
    model[2].weight.requires_grad_(False)
    fragments = _fragments(model)
    sizes = [f.global_.numel() for f in fragments]
    model[2].weight.requires_grad_(True)
    extra = nn.Parameter(torch.arange(6.0))
    model.register_parameter("extra", extra)
    seen = change(fragments, trained(model))
    assert sorted(n for n, _ in seen.joined) == ["2.weight", "extra"]
    touched = apply_change(fragments, seen, named_parameters(model))
    after = [f.global_.numel() for f in fragments]
    assert sum(after) == sum(sizes) + 16 + 6
    smallest = min(range(2), key=lambda i: (sizes[i], i))
    assert smallest in touched
    holder = next(f for f in fragments if "extra" in f.names)
    assert torch.equal(holder.global_of("extra"), torch.arange(6.0))
    assert torch.equal(holder.momentum_of("extra"), torch.zeros(6))


def test_a_parameter_whose_shape_changed_leaves_and_joins():
    model = _model()
    fragments = _fragments(model)
    model[1].weight = nn.Parameter(torch.zeros(8, 8 + 0).t().contiguous()[:4])
    seen = change(fragments, trained(model))
    assert seen.left == ["1.weight"] and [n for n, _ in seen.joined] == ["1.weight"]


def test_sites_agree_on_names_and_shapes_in_words_and_stale_optimizers_are_found():
    model = _model()
    text = describe(trained(model))
    assert text.startswith("6 tensors, 130 elements (names and shapes ")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert orphans(opt, model) == []
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert orphans(opt, model) == ["(8, 4)", "(8,)", "(8, 8)", "(8,)", "(2, 8)", "(2,)"]
    assert orphans(None, model) == []
