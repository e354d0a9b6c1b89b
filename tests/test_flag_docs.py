"""docs/flags.md is generated from launch.py's parser (tools/gen_flag_docs.py) and must
match it."""

from __future__ import annotations

import argparse

from launch import build_parser
from tools.gen_flag_docs import COMMAND, FLAGS_DOC, flag_docs


def test_flags_doc_is_current():
    assert FLAGS_DOC.read_text() == flag_docs(), (
        f"docs/flags.md is stale: regenerate it with `{COMMAND}` from the repository root"
    )


def test_every_visible_flag_is_documented_and_hidden_ones_are_not():
    doc = flag_docs()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if action.help is argparse.SUPPRESS:
                assert f"`{flag}`" not in doc
            else:
                assert f"| `{flag}`" in doc or f", `{flag}`" in doc, flag


def test_rows_keep_their_cells_and_fill_defaults():
    parser = argparse.ArgumentParser(prog="x")
    group = parser.add_argument_group("g")
    group.add_argument("--mode", choices=("a", "b"), default="a", help="a|b, '[\"*\"]' `x|y`")
    group.add_argument("--sizes", type=int, nargs="+", metavar="N", help="(default: %(default)s)")
    group.add_argument("--flag", action="store_true", help="<on>")
    rows = [line for line in flag_docs(parser).splitlines() if line.startswith("| `--")]
    assert rows == [
        "| `--mode` | `{a,b}` | a\\|b, '[\"\\*\"]' `x\\|y` |",
        "| `--sizes` | `N [N ...]` | (default: None) |",
        "| `--flag` |  | \\<on> |",
    ]
