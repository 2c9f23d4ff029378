"""Every CLI option says what it is, once: a help text with at most one default."""

import argparse

import pytest

from commpress.cli import build_parser


def _options(parser=None, prefix=""):
    """Every option of every (nested) subcommand, with the command's name."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prefix} {name}".strip())
        elif action.option_strings and action.dest != "help":
            yield prefix, action


def test_every_option_has_help_with_at_most_one_default():
    seen = 0
    for command, action in _options():
        text = action.help or ""
        where = f"commpress {command} {action.option_strings[0]}"
        assert text.strip(), f"{where} has no help"
        assert text.count("default") <= 1, f"{where}: {text!r}"
        assert "(default: None)" not in text, f"{where}: {text!r}"
        seen += 1
    assert seen > 60  # train, compare, simulate, bench, plan, testbed, demo …


def test_python_dash_m_runs_the_cli():
    """``python -m commpress`` is the CLI where no entry point is installed."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "commpress", "plan", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "commpress", "no-such-command"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no-such-command" in bad.stderr


def _numeric_options():
    """(command, flag, dest, type name) of every option that takes an int or a float."""
    for command, action in _options():
        kind = getattr(action.type, "__name__", None)
        if kind in ("int", "float") and not action.choices:
            yield command, action.option_strings[0], action.dest, kind


# plan's flags fill ClusterSpec fields of other names (GB/s and µs in the name)
PLAN_FIELDS = {"intra_bw": "intra_GBps", "inter_bw": "inter_GBps", "latency": "inter_latency_us"}
# testbed's options need a command for its ranks before they are read
COMMAND_TAIL = {"testbed": ["--", "train"]}


def test_every_command_has_its_numeric_options_checked():
    commands = {command for command, *_ in _numeric_options()}
    assert commands == {"train", "compare", "simulate", "plan", "testbed", "bench codecs",
                        "bench collectives"}
    assert sum(1 for _ in _numeric_options()) > 60


@pytest.mark.parametrize(("command", "flag", "dest", "kind"), list(_numeric_options()),
                         ids=lambda v: str(v))
def test_every_numeric_option_refuses_out_of_range_values_in_one_line(capsys, command, flag,
                                                                       dest, kind):
    """NaN, Inf and negative numbers (no option allows one) end with a one-line error
    naming the option and the value, exit code 2, before any rank starts."""
    from commpress.cli import main

    for value in (["-1"] if kind == "int" else ["nan", "inf", "-1"]):
        argv = [*command.split(), flag, value, *COMMAND_TAIL.get(command, [])]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        names = (flag, dest, PLAN_FIELDS.get(dest, dest))
        assert err.startswith("error:") and err.count("\n") == 1, (argv, err)
        assert "allowed" in err and any(n in err for n in names), (argv, err)
        assert value.lstrip("-") in err, (argv, err)


PATH_DESTS = ("json", "out", "resume", "data", "codec_throughput")


def _path_options():
    return [(command, action.option_strings[0]) for command, action in _options()
            if action.dest in PATH_DESTS]


def test_path_options_are_found():
    commands = {command for command, _ in _path_options()}
    assert {"train", "compare", "simulate", "plan", "bench codecs"} <= commands


LIST_OPTIONS = [("compare", "--policies", ","), ("simulate", "--policies", ","),
                ("plan", "--policy", ","),
                ("plan", "--outer", ","), ("bench codecs", "--codecs", ";"),
                ("bench collectives", "--codecs", ";")]


def test_the_list_options_are_found():
    # train's, compare's and simulate's --outer and --policy name one policy each
    found = {(command, action.option_strings[0]) for command, action in _options()
             if action.dest in ("policies", "codecs")
             or (command == "plan" and action.dest in ("policy", "outer"))}
    assert found == {(command, flag) for command, flag, _ in LIST_OPTIONS}


@pytest.mark.parametrize(("command", "flag", "sep"), LIST_OPTIONS, ids=lambda v: str(v))
def test_every_list_option_refuses_an_empty_name(capsys, command, flag, sep):
    """``--policies none,,sdp4bit`` ran two policies and ``--codecs ''`` every codec, in
    silence: an empty name is refused, naming the option and its value."""
    from commpress.cli import main

    for value in ("", " ", f"none{sep}{sep}int8", f"none{sep}"):
        assert main([*command.split(), flag, value]) == 2, (command, flag, value)
        err = capsys.readouterr().err
        assert f"{flag} {value!r} is not allowed: it holds an empty name" in err, err


@pytest.mark.parametrize(("command", "flag"), _path_options(), ids=lambda v: str(v))
def test_every_path_option_refuses_a_blank_path(capsys, command, flag):
    """``--resume "$CKPT"`` with the variable unset must not start a fresh run in silence,
    nor ``--json ''`` write nothing: a blank path ends with an error naming the option."""
    from commpress.cli import main

    for value in ("", "  "):
        argv = [*command.split(), flag, value, *COMMAND_TAIL.get(command, [])]
        try:
            rc = main(argv)
        except SystemExit as exit:  # argparse's own refusal
            rc = exit.code
        assert rc == 2, argv
        err = capsys.readouterr().err
        assert "allowed: a non-empty path" in err, (argv, err)
        assert flag in err or flag.lstrip("-").replace("-", "_") in err, (argv, err)


def _parse_error(capsys, argv) -> str:
    """argparse's refusal of ``argv``: exit code 2 and its message."""
    from commpress.cli import main

    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2, argv
    return capsys.readouterr().err


def test_a_flag_is_taken_only_as_written(capsys):
    """argparse's prefix match read ``bench collectives --ranks 1`` as ``--ranks-per-node
    1`` and ran the benchmark: every strict prefix of every long option is refused."""
    checked = 0
    flags = {a for _, act in _options() for a in act.option_strings}
    for command, action in _options():
        for flag in action.option_strings:
            prefix = flag[:-1]
            if not flag.startswith("--") or len(prefix) < 3 or prefix in flags:
                continue
            argv = [*command.split(), prefix, "1", *COMMAND_TAIL.get(command, [])]
            assert f"unrecognized arguments: {prefix}" in _parse_error(capsys, argv), argv
            checked += 1
    assert checked > 60


def test_every_choice_option_and_every_command_refuses_what_it_does_not_know(capsys):
    choices = [(command, action) for command, action in _options() if action.choices]
    assert len(choices) > 5
    for command, action in choices:
        # a value of the option's type outside its choices
        value = str(max(action.choices) + 1) if action.type is int else "bogus"
        flag = action.option_strings[0]
        err = _parse_error(capsys, [*command.split(), flag, value])
        assert "invalid choice:" in err and value in err and flag in err, (command, flag, err)
    for argv in (["demo", "extra"], ["demo", "--json", "x"], ["bench"], ["bench", "bogus"],
                 ["no-such-command"], []):
        assert _parse_error(capsys, argv).startswith("usage:"), argv


def test_none_means_the_default_and_off_is_not_a_number(capsys):
    from commpress.cli import build_parser

    args = build_parser().parse_args(["train", "--outer-momentum", "none", "--outer-lr", "1"])
    assert args.outer_momentum is None and args.outer_lr == 1.0
    err = _parse_error(capsys, ["train", "--outer-momentum", "off"])
    assert "--outer-momentum" in err and "'off'" in err


def test_a_boolean_option_is_a_flag_against_its_default():
    from commpress.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["train"]).tensorboard is False
    assert parser.parse_args(["train", "--tensorboard"]).tensorboard is True
    assert parser.parse_args(["train"]).progress is True
    assert parser.parse_args(["train", "--no-progress"]).progress is False
