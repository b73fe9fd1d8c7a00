"""The user docs and the packages' code describe the present: no chronology outside
benchmarks/HISTORY.md (scripts/check_wording.py says what counts)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_wording.py"

@pytest.fixture(scope="module")
def wording():
    spec = importlib.util.spec_from_file_location("check_wording", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_chronology_in_docs_or_code(wording):
    findings = wording.find()
    assert not findings, "Chronology belongs in benchmarks/HISTORY.md:\n" + "\n".join(
        map(str, findings)
    )


@pytest.mark.parametrize(
    "text",
    [
        "### Sixteenth session (AMD EPYC): the attention",
        "after fix 34 the step is faster",
        "fixes 11-15 took the peak down",
        "measured in session 16",
        "The VM's step times drift",
        "see REFERENCE.md",
    ],
)
def test_chronology_is_found(wording, text):
    assert wording.line_findings("docs/x.md", 1, text)


@pytest.mark.parametrize(
    "text",
    [
        "## A first run",
        "subprocess.Popen(cmd, start_new_session=True)",
        "the worker gets its own session, resource limits",
        '@pytest.fixture(scope="session")',
        "The fixed seed gives the same record",
        "load = wait_for_quiet(args.max_load)",
    ],
)
def test_present_tense_words_are_not_findings(wording, text):
    assert not wording.line_findings("llm_marl_envs/x.py", 1, text)


def test_load_averages_count_in_markdown_only(wording):
    line = "Measured with load average 1.6 on two cores."
    assert wording.line_findings("docs/x.md", 1, line)
    assert not wording.line_findings("benchmarks/x.py", 1, line)


def test_base_lists_only_added_lines(wording, tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "README.md").write_text("Old text from session 3.\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    (tmp_path / "README.md").write_text("Old text from session 3.\nNew, after fix 2.\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "new.md").write_text("The VM was slow.\n")
    found = {str(f) for f in wording.find(tmp_path, base="HEAD")}
    assert found == {"README.md:2: New, after fix 2.", "docs/new.md:1: The VM was slow."}
    assert len(wording.find(tmp_path)) == 3


def test_base_counts_from_where_the_branch_left_it(wording, tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q", "-b", "trunk")
    (tmp_path / "README.md").write_text("Start.\n")
    git("add", ".")
    git("commit", "-qm", "base")
    git("checkout", "-qb", "branch")
    (tmp_path / "README.md").write_text("Start.\nBranch line, fix 1.\n")
    git("commit", "-qam", "branch")
    git("checkout", "-q", "trunk")
    (tmp_path / "CONTRIBUTING.md").write_text("Trunk line from session 9.\n")
    git("add", ".")
    git("commit", "-qm", "trunk moves on")
    git("checkout", "-q", "branch")
    found = {str(f) for f in wording.find(tmp_path, base="trunk")}
    assert found == {"README.md:2: Branch line, fix 1."}
