"""One expert-parallel group's token all-to-alls, as one object: the door of the ``ep`` axis.

A mixture-of-experts layer with expert parallelism sends each token to the ranks that hold
its experts (**dispatch**) and the experts' outputs back (**combine**); backward runs the
reverse of each. The four directions tolerate compression differently — the practice of
DeepEP and torchao sends fp8 tokens to the experts and keeps the combine's forward exact —
so the policy names a codec for each: ``ep.dispatch``, ``ep.combine``,
``ep.dispatch_grad`` (the dispatch's backward, experts → tokens) and ``ep.combine_grad``
(the combine's backward, tokens → experts).

An :class:`EPExchange` holds those four codecs for one group — each one codec, or where the
policy names ``ep.<kind>.intra``/``inter`` the codecs of the links inside a node and across
nodes — and offers :meth:`~EPExchange.dispatch` and
:meth:`~EPExchange.combine`: differentiable all-to-alls (:func:`commpress.all_to_all`)
whose backward is the reverse exchange with the gradient's codec. An engine adapter (the
torchtitan one) or a model calls them where it called ``all_to_all_single``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from commpress.collectives import Topology, all_to_all
from commpress.policy import EP_KINDS, Policy
from commpress.validate import InputError


class _TokenExchange(torch.autograd.Function):
    """An all-to-all of rows whose backward is the reverse all-to-all of their gradient;
    each way's codecs as :func:`commpress.all_to_all`'s keywords (``codec``, or ``intra``,
    ``inter`` and ``topology``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, input_splits: list[int], output_splits: list[int],
                forward_codecs: dict[str, Any], backward_codecs: dict[str, Any],
                group: dist.ProcessGroup, labels: tuple[str, str]) -> torch.Tensor:
        ctx.splits = (input_splits, output_splits)
        ctx.backward_codecs, ctx.group, ctx.label = backward_codecs, group, labels[1]
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        all_to_all(out, x.detach(), output_splits, input_splits, group=group,
                   label=labels[0], **forward_codecs)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        input_splits, output_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        all_to_all(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group,
                   label=ctx.label, **ctx.backward_codecs)
        return grad_in, None, None, None, None, None, None


class EPExchange:
    """The ``ep`` codecs of one expert-parallel ``group``, by kind, from ``policy``.

    Example::

        ep = commpress.ep.EPExchange("ep-fp8", ep_group)
        routed = ep.dispatch(tokens, input_splits, output_splits)   # to the experts
        back = ep.combine(expert_out, output_splits, input_splits)  # and back
    """

    def __init__(self, policy: str | dict | Policy, group: dist.ProcessGroup | None = None,
                 label: str = "ep", topology: Topology | None = None) -> None:
        self.policy = Policy.resolve(policy)
        self.group = group
        self.label = label
        self.topology = topology or Topology()
        # each kind's codecs, as all_to_all's keywords: one codec, or the codecs of the
        # links inside a node and across nodes where the policy names ep.<kind>.intra/inter
        self.codecs = {kind: self._codecs(kind) for kind in EP_KINDS}

    def _codecs(self, kind: str) -> dict[str, Any]:
        if not self.policy.two_level("ep", kind):
            return {"codec": self.policy.codec_for("ep", kind)}
        return {"intra": self.policy.codec_for("ep", kind, "intra"),
                "inter": self.policy.codec_for("ep", kind, "inter"),
                "topology": self.topology}

    @property
    def compresses(self) -> bool:
        """Whether any of the four directions is compressed."""
        return any(not self.policy.rule("ep", kind).exact for kind in EP_KINDS)

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        """Tell each peer how many rows it will get: ``sent[j]`` (a row of counts, say one
        per expert of rank ``j``) goes to rank ``j`` → ``received[j]``, what rank ``j``
        sends this one. Exact (as float64, exact for counts below 2⁵³), under the
        agreement of :func:`commpress.all_to_all`; not differentiable."""
        peers = dist.get_world_size(self.group)
        if sent.dim() != 2 or sent.shape[0] != peers:
            raise InputError(f"EPExchange.counts: sent of shape {tuple(sent.shape)} is not "
                             f"allowed; allowed: ({peers}, n), a row per rank of the group")
        received = torch.empty(sent.shape, dtype=torch.float64, device=sent.device)
        all_to_all(received, sent.to(torch.float64), None, None, group=self.group,
                   label=f"{self.label}.counts")
        return received.to(sent.dtype)

    def dispatch(self, tokens: torch.Tensor, input_splits: list[int],
                 output_splits: list[int]) -> torch.Tensor:
        """Send ``input_splits[j]`` rows of ``tokens`` to rank ``j`` (to its experts) →
        the rows every rank sent this one, in rank order; differentiable (the backward
        sends the gradients back with ``ep.dispatch_grad``)."""
        return self._exchange(tokens, input_splits, output_splits, "dispatch")

    def combine(self, outputs: torch.Tensor, input_splits: list[int],
                output_splits: list[int]) -> torch.Tensor:
        """Send the experts' ``outputs`` back: ``input_splits[j]`` rows to rank ``j`` (the
        dispatch's output splits) → the rows for this rank's tokens (``output_splits``:
        the dispatch's input splits); the backward uses ``ep.combine_grad``."""
        return self._exchange(outputs, input_splits, output_splits, "combine")

    def _exchange(self, x: torch.Tensor, input_splits: list[int], output_splits: list[int],
                  kind: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise InputError(f"EPExchange.{kind}: tokens of {type(x).__name__} "
                             f"{tuple(getattr(x, 'shape', ()))} are not allowed; allowed: a "
                             "tensor whose first dimension is the tokens")
        labels = (f"{self.label}.{kind}", f"{self.label}.{kind}_grad")
        return _TokenExchange.apply(x, list(input_splits), list(output_splits),
                                    self.codecs[kind], self.codecs[f"{kind}_grad"],
                                    self.group, labels)

    def state_dict(self) -> dict[str, Any]:
        """The policy alone: ``ep`` codecs round to nearest, so they keep no state."""
        return {"policy": self.policy.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check :meth:`state_dict`: a state saved under another policy is refused."""
        if not isinstance(state, dict) or set(state) != {"policy"}:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise InputError(f"EPExchange state with keys {found} is not allowed; allowed: "
                             "what EPExchange.state_dict() saved (policy)")
        if state["policy"] != self.policy.to_dict():
            raise InputError(f"EPExchange state of policy {state['policy']!r}; this exchange "
                             f"runs {self.policy.to_dict()!r}: resume with the same policy")
