"""Every relative link of the Markdown docs points at a file that exists (and, for a link
into a Markdown file with ``#anchor``, at one of its headings)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted(
    {REPO / "README.md", REPO / "CONTRIBUTING.md"}
    | set(REPO.glob("docs/**/*.md"))
    | set(REPO.glob("benchmarks/*.md"))
    | set(REPO.glob("configs/**/*.md"))
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    slugs = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def links(path: Path):
    in_fence = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group(1) or match.group(2)
            if not re.match(r"^[a-z]+:", target):
                yield number, target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for number, target in links(doc):
        file, _, anchor = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{number}: {target} (no such heading)")
    assert not broken, f"{doc.relative_to(REPO)}:\n" + "\n".join(broken)


def readme_python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)


def test_readme_python_snippets_run(monkeypatch):
    """The README's Python examples run as written, from the repository's root."""
    snippets = readme_python_snippets()
    assert len(snippets) >= 2
    monkeypatch.chdir(REPO)
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
