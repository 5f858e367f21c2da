"""Every page the command line's help and the README send a reader to exists: each docs/*.md named in
`stagemesh serve --help` (and every other subcommand's help), in the README's text and links, and in the
docs pages' own relative links, down to the heading an anchor names. The README stays a page that fits a
screen or two (issue 61): everything past the quick start lives in docs/, one page per topic."""
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
LINK_WITH_ANCHOR = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
README_MAX_LINES = 300


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


def test_the_readme_fits_in_300_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move a topic into docs/ and link it"


def test_every_docs_page_has_a_title_and_the_readme_links_it():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.read_text().startswith("# "), f"{page.name} does not open with its title"
        assert f"](docs/{page.name})" in readme, f"README.md's map of docs/ lacks {page.name}"


def _slugs(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeat
    numbered; lines inside code fences are not headings."""
    slugs: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            text = line.lstrip("#").strip()
            base = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            slug, n = base, 0
            while slug in slugs:
                n += 1
                slug = f"{base}-{n}"
            slugs.add(slug)
    return slugs


def test_every_anchor_of_the_readme_and_the_docs_names_a_heading():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in LINK_WITH_ANCHOR.findall(page.read_text()):
            if "://" in target:
                continue
            dest = (page.parent / target) if target else page
            if dest.suffix == ".md" and dest.is_file() and anchor not in _slugs(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken
