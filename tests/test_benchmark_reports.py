"""The CoMLRL comparison's reports: new results never overwrite earlier ones."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_comlrl.py"


@pytest.fixture
def compare(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("compare_comlrl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HISTORY", tmp_path / "HISTORY.md")
    monkeypatch.setattr(module, "commit", lambda: "abc1234")
    return module


def test_write_docs_adds_a_dated_history_entry_above_the_earlier_ones(compare):
    compare.HISTORY.write_text(
        "# Benchmark history\n\nIntro.\n\n## 2026-01-01 · `0000000` · old\n\n| old |\n"
    )
    compare.write_docs("| first |", "_meta 1._", ["--modes", "lora"])
    compare.write_docs("| second |", "_meta 2._", ["--modes", "full"])
    text = compare.HISTORY.read_text()
    assert text.startswith("# Benchmark history\n\nIntro.\n\n## ")
    assert text.index("| second |") < text.index("| first |") < text.index("| old |")
    assert "· `abc1234` · compare_comlrl.py --modes full\n" in text
    assert compare.machine() in text and text.count("## ") == 3


def test_write_docs_into_a_history_without_entries_appends(compare):
    compare.HISTORY.write_text("# Benchmark history\n")
    compare.write_docs("| new |", "_meta._", [])
    text = compare.HISTORY.read_text()
    assert text.startswith("# Benchmark history\n\n## ") and text.endswith("_meta._\n")


def test_write_docs_without_a_history_file_says_so(compare):
    with pytest.raises(SystemExit, match="HISTORY.md does not exist"):
        compare.write_docs("| new |", "_meta._", [])
    assert not compare.HISTORY.exists()


def test_results_of_different_options_go_to_different_files(compare):
    assert compare.results_tag("full", []) == "full"
    assert compare.results_tag("lora bfloat16", []) == "lora-bfloat16"
    assert compare.results_tag("full", ["--optimizer-in-backward", "--max-grad-norm", "none"]) == (
        "full-optimizer-in-backward-max-grad-norm-none"
    )
