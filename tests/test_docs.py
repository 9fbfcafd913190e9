"""The docs stay true to the code: their relative links resolve (files and headings), and every
``--option`` they name for a ``tangram-hpc`` command is an option of that command's parser."""
from __future__ import annotations

import argparse
import re
from functools import cache
from pathlib import Path

import pytest

from tangram_hpc import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"tangram-hpc\s+([a-z][a-z-]*)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text())
    return frozenset(_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M))


def _links(path: Path):
    text = _FENCE.sub("", path.read_text())
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):        # http:, https:, mailto:
            continue
        yield target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    bad = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


def _parser_options(p: argparse.ArgumentParser) -> set[str]:
    out = set()
    for action in p._actions:
        out |= {o for o in action.option_strings if o.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _parser_options(sub)
    return out


@cache
def command_options(command: str) -> frozenset[str]:
    parser = cli.build_parser([command])
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return frozenset(_parser_options(sub.choices[command]) | _parser_options(parser))


def _command_lines(text: str):
    """Each command line a doc shows (in a code block, with its continuation lines, or in a code
    span) that runs ``tangram-hpc COMMAND``: (command, the line)."""
    for block in _FENCE.findall(text):
        lines = block.splitlines()[1:-1]
        i = 0
        while i < len(lines):
            line = lines[i]
            while i + 1 < len(lines) and (line.rstrip().endswith("\\")
                                          or (lines[i + 1][:1].isspace() and "tangram-hpc" not in lines[i + 1])):
                i += 1
                line += " " + lines[i].strip()
            i += 1
            yield from _commands_in(line.split(" #")[0])     # not the comment after it
    for span in _SPAN.findall(_FENCE.sub("", text)):
        yield from _commands_in(span)


def _commands_in(line: str):
    # a line may chain commands (a; b && c | d): each part is its own command
    for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
        m = _COMMAND.search(part)
        if m and m.group(1) in cli.COMMANDS:
            yield m.group(1), part[m.start():]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_option_a_doc_names_for_a_command_exists(doc):
    bad = []
    for command, line in _command_lines(doc.read_text()):
        for opt in _OPTION.findall(line):
            if opt not in command_options(command):
                bad.append(f"tangram-hpc {command} has no {opt}: {line.strip()[:120]}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_checks_read_what_they_check():
    """The readers find what they look for (so a passing test is not an empty one)."""
    assert "--workload" in command_options("bench") and "--worker-timeout" in command_options("coordinator")
    lines = list(_command_lines("```\ntangram-hpc bench --workload swe [--json PATH]\n"
                                "                  [--no-search]\n```\nsee `tangram-hpc status --allocations`"))
    assert lines[0][0] == "bench" and "--no-search" in lines[0][1]
    assert lines[1] == ("status", "tangram-hpc status --allocations")
    assert _slug("The native build") == "the-native-build" and _slug("`top`: a view") == "top-a-view"
    assert sum(1 for d in DOCS for _ in _links(d)) > 20
    assert sum(1 for d in DOCS for _ in _command_lines(d.read_text())) > 20
