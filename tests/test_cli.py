"""Every CLI option says what it is, once: a help text with at most one default."""

import argparse

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
