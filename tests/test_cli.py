"""Every CLI option says what it is, once: a help text with at most one default."""

import argparse

from commpress.cli import build_parser


def _options():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                yield name, action


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
