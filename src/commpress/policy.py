"""Which codec each collective gets: per parallel axis, tensor kind and link level.

A :class:`Policy` maps ``(axis, kind[, level])`` to a :class:`Rule` (a codec spec plus
``error_feedback`` and ``delta`` flags):

====  ==========================  ===========================================
axis  kinds                       collective
====  ==========================  ===========================================
dp    ``grad``, ``param``         gradient reduce-scatter / all-reduce, weight all-gather
tp    ``act``, ``act_grad``       tensor-parallel all-reduce forward / backward
pp    ``act``, ``act_grad``       pipeline send/recv forward / backward
outer ``grad``                    the pseudo-gradient all-reduce across sites
                                  (:class:`commpress.DiLoCo`)
ep    ``dispatch``, ``combine``,  expert-parallel all-to-alls of a mixture of
      ``dispatch_grad``,          experts: tokens to their experts and expert
      ``combine_grad``            outputs back (forward), and the backward of
                                  each (:class:`commpress.ep.EPExchange`)
====  ==========================  ===========================================

``dp.grad``, ``outer.grad`` and the ``ep`` kinds may be split into levels ``intra`` and
``inter`` (node-local and cross-node links; for ``outer``, inside a site and between
sites): the two-level collectives, and for ``ep`` the codec of each peer's link. A
lookup falls back from ``dp.grad.inter`` to ``dp.grad`` to exact (``none``).

Presets: ``naive`` and ``hybrid`` are this project's schemes in the spirit of Xu et al.
(CCGrid 2024) — the same codec everywhere, or aggressive on data-parallel gradients
and mild elsewhere — built from group quantizers; ``ccgrid`` follows that paper's
compressors (ZFP fixed-rate). ``sdp4bit`` and its ablations ``qw``, ``qwd``, ``tlq``,
``tlqhs`` follow Jia et al. (NeurIPS 2024); ``zeropp`` ZeRO++ (Wang et al., 2023);
``int2ef`` is ours, for DDP on slow links. A policy round-trips through a dict, YAML
and TOML:

.. code-block:: yaml

    name: my-policy
    dp:
      grad: {intra: "int8:hadamard=128", inter: "int4:hadamard=128"}
      param: {codec: "int4:group=2048", delta: true}
    tp: {act: bf16, act_grad: bf16}
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import yaml

from commpress.codecs import Codec, ErrorFeedback, codec
from commpress.files import read_regular
from commpress.validate import InputError, check_float, check_int

EP_KINDS = ("dispatch", "combine", "dispatch_grad", "combine_grad")
AXES: dict[str, tuple[str, ...]] = {"dp": ("grad", "param"), "tp": ("act", "act_grad"),
                                    "pp": ("act", "act_grad"), "outer": ("grad",),
                                    "ep": EP_KINDS}
LEVELS = ("intra", "inter")
FALLBACKS = ("off", "measured")
# the keys that may name intra/inter codecs
LEVELLED = ("dp.grad", "outer.grad", *(f"ep.{kind}" for kind in EP_KINDS))
RULE_FIELDS = ("codec", "error_feedback", "decay", "delta")


@dataclass(frozen=True)
class Rule:
    """One collective's compression: ``codec`` spec, optional error feedback, and (for
    ``dp.param`` only) ``delta``: send weight differences (qWD) instead of weights."""

    codec: str = "none"
    error_feedback: bool = False
    decay: float = 1.0  # the error-feedback residual's, per call (SparseLoCo: 0.95)
    delta: bool = False

    def build(self) -> Codec:
        """A fresh codec object (each collective keeps its own state)."""
        return codec(self.codec)

    def build_memory(self) -> ErrorFeedback | None:
        """A fresh error-feedback memory to hold beside :meth:`build`'s codec, or None."""
        return ErrorFeedback(decay=self.decay) if self.error_feedback else None

    @property
    def exact(self) -> bool:
        """Whether the collective is torch's own: no codec, no memory."""
        return self.codec == "none" and not self.error_feedback

    @cached_property  # asked per bucket call (Megatron's layouts): the spec is parsed once
    def lossy(self) -> bool:
        """Whether what arrives can differ from what was sent — the one place this is
        decided: a codec that is not lossless, or a memory (which changes what is sent)."""
        return self.error_feedback or not codec(self.codec).lossless

    def promoted(self) -> Rule:
        """This rule one rung up the guard's ladder (:func:`promote_codec`); exact keeps
        no memory and sends the values themselves, not differences."""
        up = promote_codec(self.codec)
        return dataclasses.replace(self, codec=up,
                                   error_feedback=self.error_feedback and up != "none",
                                   delta=self.delta and up != "none")

    def to_dict(self) -> str | dict[str, Any]:
        if not self.error_feedback and not self.delta:
            return self.codec
        decay = {"decay": self.decay} if self.decay != 1.0 else {}
        return {"codec": self.codec, "error_feedback": self.error_feedback, **decay,
                "delta": self.delta}


@dataclass(frozen=True)
class Guard:
    """The convergence guard of a policy's gradients (``dp.grad``; DiLoCo's ``outer.grad``):
    each bucket measures what its codes send (:class:`commpress.Watch`), summed over the
    ranks, on sampled steps — every step until a bucket has ``window`` samples under its
    codec (a run's first steps, and after each promotion), then every ``every`` steps. A
    bucket over budget in ``window`` samples in a row — or whose codes decode non-finite
    where its input was finite, at once — is promoted one rung (:func:`promote_codec`) on
    every rank alike. The budget: ``max_rel_error`` on the relative error of what is sent
    without error feedback (that error is lost), ``max_memory_ratio`` on an
    error-feedback memory's norm relative to the gradient's (that error is only
    delayed: a memory many gradients large has stopped catching up); and where the
    sharded optimizer gathers weights lossily (``dp.param``), ``max_weight_gap`` on the
    gathered weights' distance to the master weights, relative to them."""

    max_rel_error: float
    window: int = 3
    every: int = 10
    max_memory_ratio: float = 4.0
    max_weight_gap: float = 0.05

    def __post_init__(self) -> None:
        check_float("guard.max_rel_error", self.max_rel_error, gt=0)
        check_int("guard.window", self.window, ge=1)
        check_int("guard.every", self.every, ge=1)
        check_float("guard.max_memory_ratio", self.max_memory_ratio, gt=0)
        check_float("guard.max_weight_gap", self.max_weight_gap, gt=0)

    @classmethod
    def from_value(cls, policy: str, value: Any) -> Guard:
        """A guard from a policy file's ``guard:`` mapping (or a bare budget)."""
        if isinstance(value, Guard):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls(float(value))
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(value, dict) or not set(value) <= fields or "max_rel_error" not in value:
            raise InputError(f"policy {policy!r}: guard={value!r} is not allowed; allowed: a "
                             "mapping with max_rel_error (a positive number) and optionally "
                             "window and every (whole numbers ≥ 1), max_memory_ratio and "
                             "max_weight_gap (positive numbers)")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The guard as a policy file writes it: the budgets added since the first three
        fields only where they are not the default (so a policy saved before them reads
        back as the same policy)."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self)[3:]:
            if out[f.name] == f.default:
                del out[f.name]
        return out


@dataclass(frozen=True)
class Policy:
    """A named map from ``"axis.kind[.level]"`` keys to rules (missing keys: exact)."""

    name: str = "custom"
    rules: dict[str, Rule] = field(default_factory=dict)
    # "measured": each data-parallel bucket times its compressed and exact collectives on
    # the live group in its first calls and keeps compression only where it wins
    fallback: str = "off"
    # the convergence guard of the gradients' codecs (None: off)
    guard: Guard | None = None

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise InputError(f"policy {self.name!r}: fallback={self.fallback!r} is not "
                             f"allowed; allowed: {', '.join(FALLBACKS)}")
        for key, rule in self.rules.items():
            _check_key(key)
            if rule.delta and not key.startswith("dp.param"):
                raise InputError(f"policy {self.name!r}: {key}.delta=true is not allowed; "
                                 "delta (weight differences, qWD) applies to dp.param only")
            try:
                built = codec(rule.codec)
            except ValueError as e:
                raise InputError(f"policy {self.name!r}: {key}.codec: {e}") from None
            if key.startswith("ep."):
                _check_ep_rule(self.name, key, rule, built)

    # -- lookups ----------------------------------------------------------------
    def rule(self, axis: str, kind: str, level: str | None = None) -> Rule:
        """The rule for a collective, falling back from the level to the kind to exact."""
        key = f"{axis}.{kind}"
        _check_key(key if level is None else f"{key}.{level}")
        if level is not None and f"{key}.{level}" in self.rules:
            return self.rules[f"{key}.{level}"]
        return self.rules.get(key, Rule())

    def codec_for(self, axis: str, kind: str, level: str | None = None) -> Codec:
        """A fresh codec object for ``(axis, kind, level)``."""
        return self.rule(axis, kind, level).build()

    def memory_for(self, axis: str, kind: str, level: str | None = None
                   ) -> ErrorFeedback | None:
        """A fresh error-feedback memory for ``(axis, kind, level)``, or None."""
        return self.rule(axis, kind, level).build_memory()

    def names(self, axis: str) -> bool:
        """Whether the policy has any rule of ``axis`` (an adapter installs its ``ep``
        exchanges only then: with none, the engine's own exchange runs untouched)."""
        return any(key.startswith(f"{axis}.") for key in self.rules)

    def two_level(self, axis: str = "dp", kind: str = "grad") -> bool:
        """Whether the policy names separate intra- and inter-node codecs for this kind."""
        return any(f"{axis}.{kind}.{lv}" in self.rules for lv in LEVELS)

    # -- construction -------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Policy:
        """A named preset; the error lists them all."""
        if name not in PRESETS:
            raise InputError(f"unknown policy preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls.from_dict({"name": name, **preset_rules(name)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        if not isinstance(d, dict):
            raise InputError(f"a policy must be a mapping; got {type(d).__name__}")
        name = str(d.get("name", "custom"))
        rules: dict[str, Rule] = {}
        for axis, kinds in d.items():
            if axis in ("name", "fallback", "guard"):
                continue
            if axis not in AXES:
                raise InputError(f"policy {name!r}: unknown axis {axis!r}; allowed: "
                                 f"name, {', '.join(AXES)}")
            if not isinstance(kinds, dict):
                raise InputError(f"policy {name!r}: {axis} must map kinds "
                                 f"({', '.join(AXES[axis])}) to codecs; got {kinds!r}")
            for kind, value in kinds.items():
                if kind not in AXES[axis]:
                    raise InputError(f"policy {name!r}: unknown kind {axis}.{kind}; allowed: "
                                     f"{', '.join(f'{axis}.{k}' for k in AXES[axis])}")
                key = f"{axis}.{kind}"
                if isinstance(value, dict) and set(value) & set(LEVELS):
                    extra = set(value) - set(LEVELS)
                    if extra:
                        raise InputError(f"policy {name!r}: {key} mixes levels with "
                                         f"{sorted(extra)}; allowed keys: intra, inter")
                    if key not in LEVELLED:
                        raise InputError(f"policy {name!r}: levels (intra/inter) are allowed "
                                         f"for {', '.join(LEVELLED)} only; got {key}")
                    for level, leaf in value.items():
                        rules[f"{key}.{level}"] = _rule(name, f"{key}.{level}", leaf)
                else:
                    rules[key] = _rule(name, key, value)
        fallback = d.get("fallback", "off")
        if not isinstance(fallback, str):
            raise InputError(f"policy {name!r}: fallback={fallback!r} is not allowed; "
                             f"allowed: {', '.join(FALLBACKS)}")
        guard = d.get("guard")
        return cls(name=name, rules=rules, fallback=fallback,
                   guard=None if guard is None else Guard.from_value(name, guard))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Policy:
        """Load a YAML (``.yaml``/``.yml``, safe loader) or TOML (``.toml``) policy file.

        Hostile files are refused before they cost memory: at most
        :data:`MAX_POLICY_BYTES`, no YAML aliases (a few hundred bytes of nested aliases
        expand to gigabytes), nesting bounded.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise InputError(f"policy file {path!r} does not exist")
        if not path.endswith((".toml", ".yaml", ".yml")):
            raise InputError(f"policy file {path!r}: unknown extension; allowed: .yaml, .yml, "
                             ".toml")
        raw = read_regular(path, MAX_POLICY_BYTES, "policy file")  # a FIFO would block
        try:
            if path.endswith(".toml"):
                d = tomllib.loads(raw.decode())
            else:
                d = yaml.load(raw, Loader=_NoAliasLoader)  # noqa: S506 - safe, without aliases
        except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"policy file {path!r} is malformed: {e}") from None
        except RecursionError:
            raise InputError(f"policy file {path!r} is nested too deeply; a policy has at "
                             "most three levels (axis, kind, level)") from None
        d = d or {}
        if isinstance(d, dict):
            d.setdefault("name", os.path.splitext(os.path.basename(path))[0])
        return cls.from_dict(d)

    @classmethod
    def resolve(cls, spec: str | dict | Policy | None) -> Policy:
        """A policy from a preset name, a file path, a dict or a policy."""
        if spec is None:
            return cls.preset("none")
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        if spec.endswith((".yaml", ".yml", ".toml")):
            return cls.load(spec)
        return cls.preset(spec)

    def with_fallback(self, fallback: str | None) -> Policy:
        """This policy with ``fallback`` (None: as it is): how the keyword of the
        front-ends and ``--fallback`` of the trainer set it."""
        if fallback is None or fallback == self.fallback:
            return self
        return dataclasses.replace(self, fallback=fallback)

    def with_guard(self, guard: Guard | dict | float | None) -> Policy:
        """This policy with ``guard`` (None: as it is): how ``guard=`` of the front-ends
        and ``--guard`` of the trainer set it."""
        if guard is None:
            return self
        return dataclasses.replace(self, guard=Guard.from_value(self.name, guard))

    def promoted(self, keys: tuple[str, ...]) -> Policy:
        """This policy with the rules ``keys`` one rung up (:meth:`Rule.promoted`)."""
        rules = dict(self.rules)
        for key in keys:
            rules[key] = rules[key].promoted()
        return dataclasses.replace(self, rules=rules)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.fallback != "off":
            out["fallback"] = self.fallback
        if self.guard is not None:
            out["guard"] = self.guard.to_dict()
        for key, rule in sorted(self.rules.items()):
            parts = key.split(".")
            node = out.setdefault(parts[0], {})
            if len(parts) == 3:
                node = node.setdefault(parts[1], {})
            node[parts[-1]] = rule.to_dict()
        return out

    def describe(self) -> str:
        return "; ".join([f"{k}={r.codec}" + (f"+ef(decay {r.decay:g})" if r.decay != 1
                                               else "+ef" if r.error_feedback else "") +
                          ("+delta" if r.delta else "") for k, r in sorted(self.rules.items())]
                         + ([f"fallback={self.fallback}"] if self.fallback != "off" else []))


MAX_POLICY_BYTES = 1 << 16
# the guard's ladder: each lossy codec's next rung ("none": exact)
_NEXT_BITS = {"int2": "int4", "nf2": "int4", "int4": "int8", "int8": "none", "fp8": "bf16",
              "bf16": "none", "fp16": "none"}


def promote_codec(spec: str) -> str:
    """The codec spec one rung up the guard's ladder: int2 / nf2 → int4 → int8 → exact,
    fp8 → bf16 → exact; top-k keeps 4x the entries (chunked top-k 4x per chunk) until a
    quarter or more would be kept, then exact; any other lossy codec → exact. Options the
    next codec shares (group, Hadamard, scale dtype, rounding) are kept."""
    built = codec(spec)
    name, options = built.name, dict(vars(built))
    if built.lossless or name == "none":
        return "none"
    if name in ("int2", "int4", "int8"):
        up = _NEXT_BITS[name]
        if up == "none":
            return up
        options.pop("packing", None)
        return codec(f"{up}:" + ",".join(f"{k}={v}" for k, v in options.items())).spec()
    if name == "topk":
        ratio = 4 * options["ratio"]
        return "none" if ratio >= 0.25 else codec(f"topk:ratio={ratio:g}").spec()
    if name == "chunktopk":
        k = 4 * options["k"]
        return ("none" if 4 * k > options["chunk"] else
                codec(f"chunktopk:chunk={options['chunk']},k={k},bits={options['bits']},"
                      f"sigmas={options['sigmas']}").spec())
    return _NEXT_BITS.get(name, "none")


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases (``*name``) and deep nesting."""

    MAX_DEPTH = 20

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a policy file", event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > self.MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nesting deeper than {self.MAX_DEPTH} levels is not allowed",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        # PyYAML keeps the last of two equal keys; TOML refuses them, and so does this
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the constructor below names it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; allowed: each key once in a "
                    "mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_ep_rule(policy: str, key: str, rule: Rule, built: Codec) -> None:
    """An expert-parallel all-to-all exchanges rows of sizes both sides know in advance,
    its tokens are new every step, and it keeps no state (so no checkpoint holds any)."""
    if not (built.fixed_rate and built.alignment > 0):
        raise InputError(f"policy {policy!r}: {key}.codec={rule.codec!r} is not allowed; "
                         "allowed: a fixed-rate codec (none, bf16, fp16, fp8, int8, int4, "
                         "int2, sign, nf2): tokens are exchanged at sizes known in advance")
    if rule.error_feedback:
        raise InputError(f"policy {policy!r}: {key}.error_feedback=true is not allowed: a "
                         "memory belongs to the values it compresses, and the tokens an "
                         "all-to-all sends are new each step; allowed: error_feedback=false")
    if getattr(built, "rounding", "nearest") != "nearest":
        raise InputError(f"policy {policy!r}: {key}.codec={rule.codec!r} rounds "
                         "stochastically, from a counter each call advances: the same token "
                         "would get other codes after a resume or a replayed step; allowed: "
                         "rounding=nearest")


def _check_key(key: str) -> None:
    parts = key.split(".")
    ok = (len(parts) in (2, 3) and parts[0] in AXES and parts[1] in AXES[parts[0]]
          and (len(parts) == 2 or (parts[2] in LEVELS and ".".join(parts[:2]) in LEVELLED)))
    if not ok:
        allowed = [f"{a}.{k}" for a, ks in AXES.items() for k in ks]
        allowed += [f"{k}.{level}" for k in LEVELLED for level in LEVELS]
        raise InputError(f"unknown policy key {key!r}; allowed: {', '.join(allowed)}")


def _rule(policy: str, key: str, value: Any) -> Rule:
    if isinstance(value, str):
        return Rule(codec=value)
    if isinstance(value, dict):
        extra = set(value) - set(RULE_FIELDS)
        if extra:
            raise InputError(f"policy {policy!r}: {key} has unknown field(s) {sorted(extra)}; "
                             f"allowed: {', '.join(RULE_FIELDS)}")
        for flag in ("error_feedback", "delta"):
            if flag in value and not isinstance(value[flag], bool):
                raise InputError(f"policy {policy!r}: {key}.{flag}={value[flag]!r} is not "
                                 "allowed; allowed: true, false")
        decay = value.get("decay", 1.0)
        if not (isinstance(decay, int | float) and not isinstance(decay, bool)
                and 0 < decay <= 1) or (decay != 1 and not value.get("error_feedback")):
            raise InputError(f"policy {policy!r}: {key}.decay={decay!r} is not allowed; "
                             "allowed: a number in (0, 1], with error_feedback=true")
        if not isinstance(value.get("codec", "none"), str):
            raise InputError(f"policy {policy!r}: {key}.codec={value['codec']!r} must be a "
                             "codec spec string such as 'int4:group=128'")
        return Rule(**value)
    raise InputError(f"policy {policy!r}: {key}={value!r} is not allowed; allowed: a codec spec "
                     "string or a mapping with codec, error_feedback, delta")


# Group sizes follow the papers: SDP4Bit uses group 128 for gradients at both levels
# and 2048 for weight differences; ZeRO++ quantizes weights in blocks of ~4096.
_TLQHS = {"intra": "int8:hadamard=128", "inter": "int4:hadamard=128"}
_TLQ = {"intra": "int8", "inter": "int4"}
_QWD = {"codec": "int4:group=2048", "delta": True}
# For DDP on slow links: exact inside the node; across nodes absmax ternary codes
# packed five per byte (1.75 bits with fp16 scales), error feedback sends what they drop.
_INT2EF = {"intra": "none",
           "inter": {"codec": "int2:packing=trits,scale_dtype=fp16", "error_feedback": True}}
# Mixture-of-experts all-to-alls (bits per element, per direction: dispatch, combine,
# dispatch_grad, combine_grad; bf16 is 16). ep-fp8 follows DeepEP's and torchao's
# practice: e4m3 codes with a scale per 128 elements (8.25) for tokens going to experts
# forward and for the combine's gradient, which travels the same way; expert outputs and
# the dispatch's gradient exact (16). ep-int8: int8 with a scale per 128 (8.25) all four
# ways; ep-int4: int4 after a Hadamard-128 rotation (4.25) all four ways.
PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "naive": {"dp": {"grad": "int4", "param": "int4"},
              "tp": {"act": "int4", "act_grad": "int4"},
              "pp": {"act": "int4", "act_grad": "int4"},
              "ep": dict.fromkeys(EP_KINDS, "int4")},
    # TP activations as int8 (8.25 bits): chosen over fp8 and fp8 + Hadamard-128 by loss
    # at dp2 × tp2 (benchmarks/hybrid_tp_codec.py, BENCHMARKS.md); bf16, used before,
    # compressed nothing in a bf16 run
    "hybrid": {"dp": {"grad": {"intra": "int8:hadamard=128", "inter": "int4:hadamard=128"},
                      "param": "int8"},
               "tp": {"act": "int8", "act_grad": "int8"},
               "pp": {"act": "int8", "act_grad": "int8"},
               "ep": dict.fromkeys(EP_KINDS, "int8")},
    "sdp4bit": {"dp": {"grad": _TLQHS, "param": _QWD}},
    "zeropp": {"dp": {"grad": {"intra": "int4", "inter": "int4"}, "param": "int8:group=4096"}},
    "qw": {"dp": {"param": "int4:group=2048"}},
    "qwd": {"dp": {"param": _QWD}},
    "tlq": {"dp": {"grad": _TLQ}},
    "tlqhs": {"dp": {"grad": _TLQHS}},
    "int2ef": {"dp": {"grad": _INT2EF}},
    "ep-fp8": {"ep": {"dispatch": "fp8", "combine_grad": "fp8"}},
    "ep-int8": {"ep": dict.fromkeys(EP_KINDS, "int8")},
    "ep-int4": {"ep": dict.fromkeys(EP_KINDS, "int4:hadamard=128")},
    # Across sites (commpress.DiLoCo, torchft): pseudo-gradients exact inside a site, coded
    # between sites. Bits per element between sites: exact 32; int8 (group 128, fp32
    # scales) 8.25; int4 + Hadamard-128 4.25; ternary trits (five per byte, fp16 scales
    # per 128) 1.725, with error feedback; ``diloco-sparse``: SparseLoCo's chunked top-k
    # (64 of each 4096, 2-bit values through a table of bin means, 12-bit indices: 0.234)
    # with error feedback fading by 0.95 per sync; ``diloco-topk``, the former sparse
    # preset: top-k 2 % as fp32 values + int32 indices (1.28) with error feedback.
    # ``outer_step``: the outer SGD's (lr, momentum) where it is not DiLoCo's Nesterov
    # 0.7 / 0.9 — top-k's error feedback already carries the past (SparseLoCo's plain
    # averaging): momentum on top overshoots at every sync.
    "diloco": {"outer": {}},
    "diloco-int8": {"outer": {"grad": {"intra": "none", "inter": "int8"}}},
    "diloco-int4": {"outer": {"grad": {"intra": "none", "inter": "int4:hadamard=128"}}},
    "diloco-int2ef": {"outer": {"grad": _INT2EF}},
    "diloco-sparse": {"outer": {"grad": {"intra": "none", "inter": {
        "codec": "chunktopk", "error_feedback": True, "decay": 0.95}}},
        "outer_step": (1.0, 0.0)},
    "diloco-topk": {"outer": {"grad": {"intra": "none", "inter": {
        "codec": "topk:ratio=0.02", "error_feedback": True}}}, "outer_step": (1.0, 0.0)},
    # The CCGrid paper's choice of compressors, as far as the libraries here allow: ZFP
    # fixed-rate everywhere — aggressive (8 bits per value) on data-parallel gradients,
    # mild (16) on weights and on tensor/pipeline activations. Its lossless GPU
    # compressor (MPC) has no counterpart that runs everywhere: on CUDA, a policy file
    # can put nvcomp:algorithm=ans on dp.param.
    "ccgrid": {"dp": {"grad": "zfp:rate=8", "param": "zfp:rate=16"},
               "tp": {"act": "zfp:rate=16", "act_grad": "zfp:rate=16"},
               "pp": {"act": "zfp:rate=16", "act_grad": "zfp:rate=16"}},
}


def list_presets() -> list[str]:
    """The presets of a run's own collectives (the cross-site ones: :func:`outer_presets`)."""
    return [name for name, entry in PRESETS.items() if "outer" not in entry]


def outer_presets() -> list[str]:
    """The cross-site presets (:class:`commpress.DiLoCo`, torchft)."""
    return [name for name, entry in PRESETS.items() if "outer" in entry]


def preset_rules(name: str) -> dict[str, Any]:
    """A preset's rules, by axis (what :meth:`Policy.from_dict` reads)."""
    return {k: v for k, v in PRESETS[name].items() if k != "outer_step"}


def preset_outer_step(name: str) -> tuple[float, float] | None:
    """The outer SGD's ``(lr, momentum)`` a cross-site preset names, or None."""
    return PRESETS.get(name, {}).get("outer_step")
