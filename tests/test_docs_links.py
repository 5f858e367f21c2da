"""Every page the command line's help and the README send a reader to exists: each docs/*.md named in
`stagemesh serve --help` (and every other subcommand's help), in the README's text and links, and in the
docs pages' own relative links."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_PATH = re.compile(r"docs/[A-Za-z0-9_.-]+\.md")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")  # a markdown link's target, without its anchor


def _missing(paths) -> list[str]:
    return sorted({p for p in paths if not (ROOT / p).is_file()})


def test_every_docs_page_serve_help_names_exists():
    out = subprocess.run([sys.executable, "-m", "stagemesh", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    named = DOCS_PATH.findall(out.stdout)
    assert "docs/speculative-decoding.md" in named  # (--speculative-config's help)
    assert not _missing(named), _missing(named)


@pytest.mark.parametrize("command", ["router", "scheduler", "stage", "generate", "plan", "bench", "rollout",
                                     "scale"])
def test_every_docs_page_a_subcommands_help_names_exists(command):
    from stagemesh.entry.cli import build_parser

    parser = build_parser(only=command)
    [sub] = [a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0]))]
    text = sub.choices[command].format_help()
    assert not _missing(DOCS_PATH.findall(text)), _missing(DOCS_PATH.findall(text))


def test_every_docs_page_and_link_of_the_readme_and_the_docs_exists():
    named = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        named += DOCS_PATH.findall(text)
        for target in LINK.findall(text):
            if "://" not in target and not target.startswith("mailto:"):
                named.append(os.path.relpath(page.parent / target, ROOT))
    assert "docs/speculative-decoding.md" in named
    assert not _missing(named), _missing(named)
