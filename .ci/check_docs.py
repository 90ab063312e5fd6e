#!/usr/bin/env python3
"""Check the Markdown docs: every relative link resolves, and README.md stays short.

    python3 .ci/check_docs.py [--allow-missing PATH ...]

A relative link (``[text](path)``, ``![alt](path)``, optionally ``path#anchor``) must name a file
or folder that exists, relative to the page; an anchor into a Markdown page must match one of its
headings (GitHub's slug rules). Links to http(s)/mailto and pure ``#anchor`` links into the same
page are checked the same way for the anchor only. ``PENDING_PAGES`` (and ``--allow-missing``) name pages
that another branch adds (repository-relative paths). Exit status 1 lists every broken link.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 150
# user pages that branches in flight add (remove each once it is on main)
PENDING_PAGES: list[str] = []
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.md"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).exists()]


def prose_lines(text: str):
    """Lines outside fenced code blocks and indented code, with their numbers."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            s = slug(m.group(1))
            k = seen.get(s, 0)
            out.add(s if k == 0 else f"{s}-{k}")
            seen[s] = k + 1
    return out


def check(allow_missing: set[str]) -> list[str]:
    errors = []
    for page in markdown_files():
        text = page.read_text()
        for n, line in prose_lines(text):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
                where = f"{page.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    if rel not in allow_missing:
                        errors.append(f"{where}: no such file")
                    continue
                if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    errors.append(f"{where}: no heading #{anchor} in {rel}")
    readme = ROOT / "README.md"
    lines = len(readme.read_text().splitlines())
    if lines > README_MAX_LINES:
        errors.append(f"README.md: {lines} lines, more than {README_MAX_LINES}")
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--allow-missing", nargs="*", default=[], metavar="PATH",
                   help="repository-relative pages another branch adds")
    errors = check(set(PENDING_PAGES) | set(p.parse_args(argv).allow_missing))
    for e in errors:
        print(e)
    print(f"{len(errors)} problem(s)" if errors else "docs: every relative link resolves; README.md is short")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
