import pytest

from commpress import Policy, list_presets
from commpress.codecs import ErrorFeedback
from commpress.validate import InputError


def test_presets_build_and_roundtrip():
    for name in list_presets():
        p = Policy.preset(name)
        assert Policy.from_dict(p.to_dict()) == p


def test_sdp4bit_preset_is_the_paper():
    p = Policy.preset("sdp4bit")
    assert p.rule("dp", "grad", "intra").codec == "int8:hadamard=128"
    assert p.rule("dp", "grad", "inter").codec == "int4:hadamard=128"
    assert p.rule("dp", "param").delta and p.rule("dp", "param").codec == "int4:group=2048"
    assert p.rule("tp", "act").exact and p.two_level()


def test_fallback_and_error_feedback():
    p = Policy.from_dict({"dp": {"grad": {"codec": "int2", "error_feedback": True}}})
    assert p.rule("dp", "grad", "inter").codec == "int2"
    assert isinstance(p.memory_for("dp", "grad"), ErrorFeedback)
    assert p.codec_for("dp", "grad").name == "int2"  # the codec alone, memory beside it
    assert p.memory_for("dp", "param") is None
    assert p.rule("pp", "act").codec == "none"


def test_yaml_and_toml_files(tmp_path):
    y = tmp_path / "mine.yaml"
    y.write_text("dp:\n  grad: {intra: int8, inter: int4}\n  param: bf16\ntp:\n  act: fp16\n")
    p = Policy.load(y)
    assert p.name == "mine" and p.rule("dp", "grad", "inter").codec == "int4"
    t = tmp_path / "mine.toml"
    t.write_text('name = "t"\n[dp]\nparam = "int8"\n[pp]\nact = "int4:hadamard=64"\n')
    assert Policy.load(t).rule("pp", "act").codec == "int4:hadamard=64"
    assert Policy.resolve(str(t)).name == "t"


@pytest.mark.parametrize(("d", "needle"), [
    ({"xp": {}}, "unknown axis 'xp'; allowed: name, dp, tp, pp, outer"),
    ({"dp": {"weights": "int4"}}, "unknown kind dp.weights; allowed: dp.grad, dp.param"),
    ({"dp": {"grad": "int5"}}, "dp.grad.codec: unknown codec 'int5'"),
    ({"tp": {"act": {"intra": "int8"}}},
     "levels (intra/inter) are allowed for dp.grad, outer.grad, ep.dispatch"),
    ({"tp": {"act": {"codec": "int8", "delta": True}}}, "delta (weight differences, qWD)"),
    ({"dp": {"grad": {"codec": "int8", "ef": True}}}, "unknown field(s) ['ef']"),
    ({"dp": {"grad": {"codec": "int8", "error_feedback": "yes"}}}, "error_feedback='yes'"),
])
def test_schema_errors_name_field_value_and_allowed(d, needle):
    with pytest.raises(ValueError) as info:
        Policy.from_dict(d)
    assert needle in str(info.value)


def test_unknown_preset_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="unknown policy preset 'fast'; allowed: none, naive"):
        Policy.preset("fast")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp: [unclosed\n")
    with pytest.raises(ValueError, match="is malformed"):
        Policy.load(bad)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[dp\n")
    with pytest.raises(ValueError, match="is malformed"):
        Policy.load(bad_toml)
    with pytest.raises(ValueError, match="does not exist"):
        Policy.load(tmp_path / "nope.yaml")
    danger = tmp_path / "danger.yaml"
    danger.write_text("dp: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="is malformed"):
        Policy.load(danger)  # the safe loader refuses python tags


@pytest.mark.parametrize("text, key", [
    ("dp:\n  grad: int4\ndp:\n  grad: int8\n", "dp"),             # top level
    ("dp:\n  grad: {intra: int8, intra: int4}\n", "intra"),         # inside a rule
    ("name: a\ntp: {act: int8}\nname: b\n", "name"),
])
def test_a_yaml_key_given_twice_is_refused_as_toml_refuses_it(tmp_path, text, key):
    """PyYAML keeps the last of two equal keys: a policy would silently differ from what
    its first lines say."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=f"key '{key}' is given twice; allowed: each key once"):
        Policy.load(path)
    toml = tmp_path / "twice.toml"
    toml.write_text('[dp]\ngrad = "int4"\n[dp]\ngrad = "int8"\n')
    with pytest.raises(InputError, match="is malformed"):
        Policy.load(toml)


def test_every_preset_is_in_one_table():
    from commpress.policy import PRESETS, list_presets, outer_presets, preset_outer_step

    inner, outer = list_presets(), outer_presets()
    assert set(inner) | set(outer) == set(PRESETS) and not set(inner) & set(outer)
    for name in PRESETS:  # each builds, by the one lookup
        assert Policy.preset(name).name == name
    assert preset_outer_step("diloco-sparse") == (1.0, 0.0)
    assert preset_outer_step("diloco-int4") is None and preset_outer_step("sdp4bit") is None


def test_an_error_feedback_decay_is_a_rule_field_and_ranks_agree_on_it():
    policy = Policy.from_dict({"name": "p", "outer": {"grad": {"intra": "none", "inter": {
        "codec": "chunktopk", "error_feedback": True, "decay": 0.95}}}})
    rule = policy.rule("outer", "grad", "inter")
    assert rule.decay == 0.95 and rule.build_memory().spec() == "ef:decay=0.95"
    assert Policy.from_dict(policy.to_dict()).rule("outer", "grad", "inter") == rule
    assert Policy.preset("diloco-sparse").rule("outer", "grad", "inter") == rule
    for bad in ({"codec": "int2", "decay": 0.9},  # no memory to fade
                {"codec": "int2", "error_feedback": True, "decay": 0}):
        with pytest.raises(InputError, match=r"decay=.* is not allowed; allowed: a number in "
                                             r"\(0, 1\], with error_feedback=true"):
            Policy.from_dict({"name": "p", "dp": {"grad": bad}})
