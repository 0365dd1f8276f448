#!/usr/bin/env python3
"""Checks README.md and every page under docs/: word counts and links.

* Each page holds at most MAX_PAGE_WORDS words and all of them together at most MAX_TOTAL_WORDS,
  counted as `wc -w` counts them (runs of non-blank characters).
* Every relative link ([text](path), [text](path#anchor), [text](#anchor) and reference
  definitions `[name]: path`) outside code resolves: the file or folder exists, and an anchor
  names a heading of the target page (GitHub's slugs: lower case, punctuation dropped, blanks
  as hyphens, `-1`, `-2` ... for repeated headings) or an explicit `<a id="...">`.

Exits 1 with one line per finding, naming the page and the link; 0 when all is well.
Usage: scripts/docs_check.py [--counts]   (--counts also prints each page's words)
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_PAGE_WORDS = 3000
MAX_TOTAL_WORDS = 40000

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(
    r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\".*\")?\s*$")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def pages() -> list[Path]:
    """README.md and every .md file under docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def words(text: str) -> int:
    return len(text.split())


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced, marker = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if not fenced:
                fenced, marker = True, m.group(1)
                continue
            if line.strip().startswith(marker):
                fenced = False
                continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    kept = []
    for ch in text:
        category = unicodedata.category(ch)
        if ch in " -_" or category[0] in "LN" or category == "Mn":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def anchors(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        found: set[str] = set()
        seen: dict[str, int] = {}
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            found.update(EXPLICIT_ANCHOR.findall(line))
            m = HEADING.match(line)
            if not m:
                continue
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of each link outside code."""
    out = []
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        for pattern in (INLINE_LINK, IMAGE_LINK, REFERENCE_DEF):
            out.extend((number, target) for target in pattern.findall(line))
    return out


def check_link(page: Path, target: str, cache: dict[Path, set[str]]) -> str | None:
    """None when the link resolves, else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    resolved = page if not path_part else (page.parent / path_part).resolve()
    if not resolved.exists():
        return f"no file {path_part}"
    if ROOT not in resolved.parents and resolved != ROOT:
        return f"{path_part} lies outside the repository"
    if anchor:
        if resolved.suffix != ".md" or resolved.is_dir():
            return f"an anchor into {path_part}, which is not a page"
        if anchor not in anchors(resolved, cache):
            where = path_part or page.name
            return f"no heading with the anchor #{anchor} in {where}"
    return None


def main(argv: list[str]) -> int:
    show_counts = "--counts" in argv
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    total = 0
    for page in pages():
        name = page.relative_to(ROOT).as_posix()
        text = page.read_text(encoding="utf-8")
        count = words(text)
        total += count
        if show_counts:
            print(f"{count:6d} {name}")
        if count > MAX_PAGE_WORDS:
            problems.append(f"{name}: {count} words, over the {MAX_PAGE_WORDS} a page may hold")
        for number, target in links(text):
            why = check_link(page, target, cache)
            if why:
                problems.append(f"{name}:{number}: link ({target}) does not resolve: {why}")
    if show_counts:
        print(f"{total:6d} total")
    if total > MAX_TOTAL_WORDS:
        problems.append(
            f"README.md and docs/: {total} words in all, over the {MAX_TOTAL_WORDS} allowed"
        )
    for problem in problems:
        print(f"docs_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
