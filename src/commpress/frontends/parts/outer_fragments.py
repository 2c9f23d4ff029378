"""DiLoCo's fragments, and the trained parameters they follow as the model changes.

A fragment is a run of the model's trained parameters, *by name*, with their
``θ_global`` and outer momentum (flat fp32) and their codecs (a :class:`DPBucket`). Names,
not tensor objects: ``model.load_state_dict(..., assign=True)`` replaces the tensors, and a
synchronizer that held the old ones would sync orphans while the model trains the new.

The trained set — the parameters that require gradients — is read again at every sync.
When it changes (progressive unfreezing, a layer frozen, a module added to the model),
the fragments are re-formed at that sync, on every site alike (the sites agree on the set
first): a parameter that left is put back to its ``θ_global`` (the value every site
agreed on last; a frozen parameter never takes an outer step, which its momentum would
otherwise give it) and dropped with its momentum; one that joined starts its ``θ_global``
from the first rank's weights (broadcast: an added module starts from different random
weights on every site) in the fragment with the fewest elements. Re-formed fragments'
codecs start fresh: their error-feedback memory was laid out for the old fragment. The
alternative — fixing the set at construction — left sites diverging silently in each of
these cases. A parameter that is frozen from the start holds no ``θ_global`` (a LoRA run's
frozen base would otherwise cost an fp32 copy of the whole model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from commpress.collectives import Topology
from commpress.dp import DPBucket
from commpress.policy import Policy
from commpress.validate import InputError, few


class Fragment:
    """One fragment: its parameters' names and shapes, ``θ_global`` and momentum (flat
    fp32), and its codecs (a :class:`DPBucket` of the policy's ``outer.grad`` rules)."""

    def __init__(self, index: int, named: list[tuple[str, torch.Tensor]], policy: Policy,
                 topology: Topology, label: str) -> None:
        self.index = index
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        # θ_global starts from the (broadcast) local weights
        self.global_ = _flat([p for _, p in named])
        self.momentum = torch.zeros_like(self.global_)
        # the fragments' codecs are their own objects: one label counts them all
        self.dp = DPBucket(policy, topology, label, axis="outer")

    @property
    def numels(self) -> list[int]:
        return [_numel(s) for s in self.shapes]

    def params(self, model: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This fragment's parameters as the model holds them now."""
        return [model[n] for n in self.names]

    def local(self, model: dict[str, torch.Tensor]) -> torch.Tensor:
        return _flat(self.params(model))

    @torch.no_grad()
    def set_local(self, model: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
        for p, part in zip(self.params(model), flat.split(self.numels)):
            p.copy_(part.view_as(p))

    def global_of(self, name: str) -> torch.Tensor:
        """``θ_global`` of one parameter (a view, flat)."""
        return self.global_[self._span(name)]

    def momentum_of(self, name: str) -> torch.Tensor:
        return self.momentum[self._span(name)]

    def _span(self, name: str) -> slice:
        i = self.names.index(name)
        start = sum(self.numels[:i])
        return slice(start, start + self.numels[i])

    @torch.no_grad()
    def outer_step(self, delta: torch.Tensor, lr: float, momentum: float,
                   nesterov: bool) -> None:
        """The outer SGD on ``θ_global`` with the averaged pseudo-gradient ``delta``,
        as torch's SGD: ``buf = μ·buf + Δ``; Nesterov's update ``Δ + μ·buf``."""
        self.momentum.mul_(momentum).add_(delta)
        update = delta.add(self.momentum, alpha=momentum) if nesterov else self.momentum
        self.global_.sub_(update, alpha=lr)

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "global": self.global_.clone(),
                "momentum": self.momentum.clone(), "codecs": self.dp.state_dict()}

    def load_state_dict(self, saved: dict[str, Any], named: list[tuple[str, torch.Tensor]],
                        memory: bool) -> None:
        """Restore :meth:`state_dict`'s state, for the model's parameters ``named``
        (:func:`check_layout`); ``memory=False``: the codecs start fresh."""
        if self.names != saved["names"]:
            self.reform([], named)
        self.global_.copy_(saved["global"])
        self.momentum.copy_(saved["momentum"])
        self.dp.load_state_dict(saved["codecs"], memory)

    def reform(self, keep: list[str], joined: list[tuple[str, torch.Tensor]]) -> None:
        """Keep the parameters ``keep`` (with their θ_global and momentum) and add
        ``joined`` (θ_global from their values, no momentum); the codecs start fresh."""
        kept = [(n, s) for n, s in zip(self.names, self.shapes) if n in keep]
        globals_ = [self.global_of(n) for n, _ in kept] + [p.detach().reshape(-1).float()
                                                           for _, p in joined]
        momenta = [self.momentum_of(n) for n, _ in kept] + [
            torch.zeros(p.numel(), device=self.global_.device) for _, p in joined]
        self.names = [n for n, _ in kept] + [n for n, _ in joined]
        self.shapes = [s for _, s in kept] + [tuple(p.shape) for _, p in joined]
        self.global_ = _cat(globals_, self.global_)
        self.momentum = _cat(momenta, self.momentum)
        self.dp.fresh()


def named_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` by name (frozen ones too), as it holds them now."""
    return dict(model.named_parameters())


def trained(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters that require gradients, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def describe(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What sites must agree on about a trained set: its size, readable, and a digest of
    its names and shapes (the mismatch error shows both)."""
    named = list(named)
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    elements = sum(p.numel() for _, p in named)
    return f"{len(named)} tensors, {elements:,} elements (names and shapes {digest})"


@dataclass
class Change:
    """How the trained set differs from the fragments': names that ``left`` and
    ``joined`` (a parameter whose shape changed does both)."""

    left: list[str]
    joined: list[tuple[str, torch.Tensor]]

    def __bool__(self) -> bool:
        return bool(self.left or self.joined)


def change(fragments: list[Fragment], now: list[tuple[str, torch.Tensor]]) -> Change:
    held = {n: s for f in fragments for n, s in zip(f.names, f.shapes)}
    shapes_now = {n: tuple(p.shape) for n, p in now}
    left = [n for n, s in held.items() if shapes_now.get(n) != s]
    joined = [(n, p) for n, p in now if held.get(n) != tuple(p.shape)]
    return Change(left, joined)


@torch.no_grad()
def apply_change(fragments: list[Fragment], change: Change,
                 model: dict[str, torch.Tensor]) -> list[int]:
    """Re-form ``fragments`` for ``change`` (module docstring); ``joined`` must already
    hold the agreed weights. Returns the indices of the fragments re-formed."""
    left = set(change.left)
    touched = set()
    for f in fragments:
        for n, s in zip(f.names, f.shapes):
            if n in left:
                touched.add(f.index)
                p = model.get(n)
                if p is not None and tuple(p.shape) == s:  # frozen: back to the agreed value
                    p.copy_(f.global_of(n).view_as(p))
    sizes = {f.index: sum(s for n, s in zip(f.names, f.numels) if n not in left)
             for f in fragments}
    joining: dict[int, list[tuple[str, torch.Tensor]]] = {f.index: [] for f in fragments}
    for n, p in change.joined:
        smallest = min(sizes, key=lambda i: (sizes[i], i))
        joining[smallest].append((n, p))
        sizes[smallest] += p.numel()
        touched.add(smallest)
    for f in fragments:
        if f.index in touched:
            f.reform([n for n in f.names if n not in left], joining[f.index])
    return sorted(touched)


def orphans(optimizer: torch.optim.Optimizer | None, model: nn.Module) -> list[str]:
    """The shapes of tensors ``optimizer`` steps that are not parameters of ``model``:
    never synchronized (a module added to the optimizer, not the model; the optimizer
    still holding the tensors ``load_state_dict(..., assign=True)`` replaced)."""
    if optimizer is None:
        return []
    mine = {id(p) for p in model.parameters()}
    return [str(tuple(p.shape)) for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad and id(p) not in mine]


def refuse_orphans(shapes: list[str]) -> None:
    if shapes:
        raise InputError(
            f"DiLoCo: the inner optimizer steps {len(shapes)} tensors that are not "
            f"parameters of the model (shapes {few(shapes, 4)}): DiLoCo synchronizes the model's "
            "parameters, so those would never be synchronized. Allowed: a module added to "
            "the model before add_param_group, and an optimizer made after "
            "model.load_state_dict(..., assign=True) (which replaces the tensors)")


def check_layout(saved: dict[str, Any], model: dict[str, torch.Tensor]
                  ) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters of a saved fragment, refused by name if one is missing or
    of another size."""
    names = saved.get("names") if isinstance(saved, dict) else None
    if not isinstance(names, list):
        raise InputError("DiLoCo checkpoint fragment has no parameter names: not a DiLoCo "
                         "state of this version")
    out = []
    offset = 0
    for n in names:
        p = model.get(n)
        if p is None:
            raise InputError(f"DiLoCo checkpoint holds parameter {n!r}, which this model "
                             "does not have; resume with the same model")
        out.append((n, p))
        offset += p.numel()
    if offset != saved["global"].numel():
        raise InputError(f"DiLoCo checkpoint fragment of {saved['global'].numel()} elements "
                         f"for parameters of {offset} in this model; resume with the same "
                         "model")
    return out


def split(named: list[tuple[str, torch.Tensor]],
          fragments: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Contiguous fragments in registration order, about equal in elements, none empty."""
    total = sum(p.numel() for _, p in named)
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    seen = 0
    for i, (n, p) in enumerate(named):
        left_params, left_fragments = len(named) - i, fragments - len(out)
        # a parameter whose middle lies past this fragment's share starts the next
        full = seen + p.numel() / 2 > len(out) * total / fragments and out[-1]
        if left_fragments and (full or left_params == left_fragments):
            out.append([])
        out[-1].append((n, p))
        seen += p.numel()
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params]) if params else (
        torch.zeros(0))


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros(0)
