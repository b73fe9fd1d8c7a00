"""List lines of the user docs and the packages' code that tell history instead of the present.

The docs and docstrings say what the project is and does today; the chronology (dated runs,
keyed by commit) lives in benchmarks/HISTORY.md only. This script finds what slips back in:
ordinal run headings ("Sixteenth session"), "fix 34" / "fixes 11-15", a work "session",
"the VM", "REFERENCE.md", and load averages in Markdown. OS-level process words
("new session", ``start_new_session``, ``os.setsid``) and pytest's ``scope="session"`` are
not findings.

    python scripts/check_wording.py                  # every line of the checked files
    python scripts/check_wording.py --base main      # only lines this branch adds since it
                                                     # left main (the working tree included;
                                                     # new untracked files count whole)

Prints ``file:line: text`` per finding and exits with status 1 when there is any.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Checked files, as globs relative to the repository root.
CHECKED = (
    "README.md",
    "CONTRIBUTING.md",
    "docs/**/*.md",
    "benchmarks/*.md",
    "llm_marl_envs/**/*.py",
    "magrpo/**/*.py",
    "benchmarks/**/*.py",
    "examples/**/*.py",
)
#: The one place for the chronology.
EXEMPT = ("benchmarks/HISTORY.md",)

_ORDINALS = (
    "third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
RULES: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    # (name, pattern, Markdown only)
    ("ordinal run", re.compile(r"\b(?:first|second)[- ]sessions?\b", re.I), False),
    ("ordinal run", re.compile(rf"\b(?:{_ORDINALS})\W+(?:\w+\W+)?(?:session|run|round)s?\b", re.I),
     False),
    ("fix number", re.compile(r"\bfix(?:es)?\s+#?\d+", re.I), False),
    ("work session", re.compile(r"\bsessions?\b", re.I), False),
    ("the VM", re.compile(r"\b(?i:the|this|that|our|a) VM'?s?\b"), False),
    ("REFERENCE.md", re.compile(r"REFERENCE\.md"), False),
    ("load average", re.compile(r"\bload averages?\b|\bload \d+\.\d+\s*/\s*\d", re.I), True),
)
#: Uses of "session" that are about processes or pytest, not about work.
SESSION_OK = re.compile(
    r"new[_ ]session|setsid|scope\s*=\s*[\"']session[\"']|session[- ]scoped|"
    r"session (?:leader|id)|process group|\bown session|'s session|kill(?:s|ed)? (?:the )?session",
    re.I,
)


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the repository root, with forward slashes
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text.strip()}"


def checked_files(root: Path = REPO) -> list[str]:
    files: set[str] = set()
    for pattern in CHECKED:
        for path in root.glob(pattern):
            relative = path.relative_to(root).as_posix()
            if path.is_file() and relative not in EXEMPT and "/.venv" not in f"/{relative}":
                files.add(relative)
    return sorted(files)


def line_findings(path: str, number: int, text: str) -> list[Finding]:
    markdown = path.endswith(".md")
    found = []
    for name, pattern, markdown_only in RULES:
        if markdown_only and not markdown:
            continue
        if pattern.search(text) is None:
            continue
        if name == "work session" and SESSION_OK.search(text):
            continue
        found.append(Finding(path, number, name, text))
        break  # one finding per line is enough to point at it
    return found


def added_lines(base: str, files: list[str], root: Path = REPO) -> dict[str, set[int]]:
    """Line numbers (in the working tree) that the diff from ``base`` adds, per file.

    The diff starts at the merge base of ``base`` and HEAD, so lines that ``base`` gained
    since this branch left it do not count as added here."""
    fork = subprocess.run(["git", "merge-base", base, "HEAD"], cwd=root, capture_output=True,
                          text=True)
    if fork.returncode == 0:
        base = fork.stdout.strip()
    diff = subprocess.run(
        ["git", "diff", "--unified=0", "--no-color", "--no-ext-diff", base, "--", *files],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout
    added: dict[str, set[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@") and current is not None:
            match = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
            start, count = int(match.group(1)), int(match.group(2) or 1)
            added.setdefault(current, set()).update(range(start, start + count))
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--", *files],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout.split()
    for path in untracked:
        count = len((root / path).read_text(errors="replace").splitlines())
        added[path] = set(range(1, count + 1))
    return added


def find(root: Path = REPO, base: str | None = None) -> list[Finding]:
    files = checked_files(root)
    only = added_lines(base, files, root) if base is not None else None
    findings = []
    for path in files:
        if only is not None and path not in only:
            continue
        lines = (root / path).read_text(errors="replace").splitlines()
        for number, text in enumerate(lines, start=1):
            if only is None or number in only[path]:
                findings.extend(line_findings(path, number, text))
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", metavar="REV",
                        help="only lines added since the merge base of REV and HEAD "
                             "(the working tree included)")
    args = parser.parse_args(argv)
    findings = find(base=args.base)
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
