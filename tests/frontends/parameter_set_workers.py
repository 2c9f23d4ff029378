"""The trained parameters changed mid-run under the DDP hook and the sharded optimizer:
what each front-end does when a parameter is frozen, unfrozen, added or replaced after
it was built (DiLoCo follows the model: test_diloco)."""

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from tests.frontends import workers

CHANGE_AFTER = 1  # the change comes after this step


def _change(model, opt, change, rank):
    change, _, only = change.partition("@")  # "freeze@0": on rank 0 alone
    if only and int(only) != rank:
        return
    if change == "freeze":
        model.blocks[1].mlp.fc.weight.requires_grad_(False)
    elif change == "unfreeze":
        model.wte.weight.requires_grad_(True)
    elif change == "add":
        model.extra = torch.nn.Linear(64, 3)
        opt.add_param_group({"params": list(model.extra.parameters())})
    elif change == "assign":
        model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    elif change == "hold still":  # the way offered: lr 0 in a group of their own
        for group in opt.param_groups:  # the sharded optimizer's groups are per bucket
            if group["param_group"] == 1:
                group["lr"] = 0.0


def changed_mid_run(rank, world, front_end, change, steps=4):
    """Train ``steps`` steps with ``front_end`` (``ddp`` hook, ``sharded``); apply ``change``
    after step :data:`CHANGE_AFTER`. The hash of every parameter after each step, or the
    error the change met."""
    data = workers._data()
    model = workers._model(seed=rank)
    if change.startswith("unfreeze"):
        model.wte.weight.requires_grad_(False)
    held = [model.blocks[1].mlp.fc.weight]
    others = [p for p in model.parameters() if all(p is not h for h in held)]
    if front_end == "ddp":
        forward = DDP(model, bucket_cap_mb=0.1,
                      find_unused_parameters=change.startswith("freeze"))
        forward.register_comm_hook(*commpress.ddp_hook(forward, "int8", bucket_numel=25_000))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        forward = model
        groups = ([{"params": others}, {"params": held}] if change == "hold still"
                  else model)
        # held still: the fp32 masters do not move; qWD's weights would still close in on
        # them, so that case gathers the weights exactly
        policy = "none" if change == "hold still" else "sdp4bit"
        opt = commpress.ShardedOptimizer(groups, torch.optim.AdamW, policy, lr=3e-3,
                                         bucket_numel=30_000)
    hashes = []
    try:
        for step in range(steps):
            x, y = workers._local_batch(data, step, rank, world)
            forward(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            if step == CHANGE_AFTER:
                _change(model, opt, change, rank)
            hashes.append({"all": workers._hash_params(model),
                           "held": workers._hash_params(torch.nn.ParameterList(held))})
    except (commpress.InputError, RuntimeError) as e:  # DDP wraps its hook's errors
        return {"hashes": hashes, "error": f"{type(e).__name__}: {e}"}
    return {"hashes": hashes, "error": None}
