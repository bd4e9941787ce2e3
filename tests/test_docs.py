"""The documentation is a manual that resolves: every relative link and image of README.md and docs/ points at a
file (and heading) that exists, every file under docs/benchmarks/ is linked from a page, and no text names the
working sessions that produced it (history lives in docs/CHANGELOG.md, by date)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "docs" / "benchmarks"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
SESSION = re.compile(r"session[ _]?[0-9]", re.IGNORECASE)


def _pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "models").glob("*.md"))]


def _prose(path: pathlib.Path) -> str:
    """The page without its fenced code blocks (commands are not links)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path))]


def test_every_relative_link_and_image_resolves() -> None:
    broken = []
    for page in _pages():
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / urllib.parse.unquote(file_part)).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert broken == []


def test_every_benchmark_file_is_linked_from_a_page() -> None:
    linked = set()
    for page in _pages():
        for target in _links(page):
            file_part = target.partition("#")[0]
            if file_part and not re.match(r"^[a-z][a-z0-9+.-]*:", file_part):
                linked.add((page.parent / urllib.parse.unquote(file_part)).resolve())
    orphans = [p.name for p in sorted(BENCHMARKS.iterdir()) if p.resolve() not in linked]
    assert orphans == []


def test_no_text_names_a_working_session() -> None:
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        files = "\n".join(str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts)
    named = []
    for name in files.splitlines():
        path = ROOT / name
        if path.suffix not in {".md", ".py", ".sh", ".json", ".yaml", ".toml", ".txt"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        named += [f"{name}: {m.group(0)}" for m in SESSION.finditer(text)]
        named += [f"{name}: {path.name}" for _ in [0] if SESSION.search(path.name)]
    assert named == []
