"""The README and docs/ pages: every relative link reaches a file, every #anchor a heading, every page is linked."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose(path):
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{k}" for slug, n in seen.items() for k in range(n + 1)} | set(seen)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(PAGES) > 1
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, page.name
