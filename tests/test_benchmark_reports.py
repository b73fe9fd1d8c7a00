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
    monkeypatch.setattr(module, "DOCS", tmp_path / "benchmarks.md")
    return module


def test_write_docs_adds_a_section_above_the_earlier_ones(compare):
    compare.DOCS.write_text(
        f"# B\n\n## Results\n\n{compare.NEWEST_FIRST}\n\n### Earlier\n\n| old |\n"
    )
    compare.write_docs("| first |", "_meta 1._", ["--modes", "lora"])
    compare.write_docs("| second |", "_meta 2._", ["--modes", "full"])
    text = compare.DOCS.read_text()
    assert text.index("| second |") < text.index("| first |") < text.index("| old |")
    assert "`compare_comlrl.py --modes full`" in text and compare.machine() in text
    assert text.count(compare.NEWEST_FIRST) == 1


def test_write_docs_without_the_marker_says_where_to_put_it(compare):
    compare.DOCS.write_text("# B\n\n| old |\n")
    with pytest.raises(SystemExit, match="compare:newest-first"):
        compare.write_docs("| new |", "_meta._", [])
    assert compare.DOCS.read_text() == "# B\n\n| old |\n"  # untouched


def test_results_of_different_options_go_to_different_files(compare):
    assert compare.results_tag("full", []) == "full"
    assert compare.results_tag("lora bfloat16", []) == "lora-bfloat16"
    assert compare.results_tag("full", ["--optimizer-in-backward", "--max-grad-norm", "none"]) == (
        "full-optimizer-in-backward-max-grad-norm-none"
    )
