"""docs/planner.md shows the CLI's own output: re-run every example and check each line shown."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from kvserve.planner.cli import main

DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "planner.md")


def examples() -> list[tuple[str, list[str]]]:
    if not os.path.exists(DOC):
        return []
    text = open(DOC, encoding="utf-8").read()
    out = []
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.S):
        lines = block.rstrip("\n").split("\n")
        if lines[0].startswith("$ kvserve plan"):
            out.append((lines[0][2:], lines[1:]))
    return out


def test_docs_have_the_worked_examples():
    commands = " ".join(cmd for cmd, _ in examples())
    for needle in ("--gpu h100-sxm", "--gpu h200", "deepseek-v3", "mixtral-8x7b", "--rps 167",
                   "--ttft-p99-ms 200", "--claimed-tokens-per-s"):
        assert needle in commands


@pytest.mark.parametrize("command, shown", examples(), ids=lambda x: x if isinstance(x, str) else "")
def test_doc_example_matches_cli_output(command, shown):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        main(shlex.split(command)[1:])
    produced = set(buf.getvalue().splitlines())
    missing = [line for line in shown if line.strip() and line not in produced]
    assert not missing, f"docs/planner.md is stale for `{command}`: {missing[:3]}"
