"""benchmarks/pooled_change.py: learning.py's paired change over several held-out splits."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.fixture
def pooled_change(benchmark_script):
    return benchmark_script("pooled_change")


def stored(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def result(split: str, values: dict[int, list[float]]) -> dict:
    """A learning.py result of one metric: step -> one answer's value per problem."""
    return {
        "env": "coophumaneval-v2",
        "eval_split": split,
        "metrics": ["cooperation"],
        "answers": {
            str(step): [{"problem": i, "cooperation": v} for i, v in enumerate(vals)]
            for step, vals in values.items()
        },
    }


def test_one_result_gives_the_table_learning_py_stored(pooled_change):
    run = stored("learning_coophumaneval_t06_180.json")
    table = pooled_change.pooled_change([run])
    assert list(table) == ["0", "180"]
    for step in table:
        for name, row in table[step].items():
            assert row["value"] == pytest.approx(run["steps"][step][name]["value"])
            assert row["change"] == pytest.approx(run["steps"][step][name]["change"])


def test_two_splits_pool_their_problems_as_independent_units(pooled_change):
    eval_split = result("eval", {0: [0, 0], 180: [1, 0]})
    test_split = result("test", {0: [0, 0], 90: [0, 0], 180: [1, 1]})
    row = pooled_change.pooled_change([eval_split, test_split])["180"]["cooperation"]
    assert row["n"] == 4 and row["value"] == 0.75
    assert row["change"]["value"] == 0.75
    assert row["change"]["se"] == pytest.approx(0.25)


def test_the_same_split_twice_is_refused(pooled_change):
    run = result("eval", {0: [0], 180: [1]})
    with pytest.raises(SystemExit, match="same split"):
        pooled_change.pooled_change([run, run])


def test_results_of_different_envs_are_refused(pooled_change):
    other = {**result("test", {0: [0], 180: [1]}), "env": "humaneval-v2"}
    with pytest.raises(SystemExit, match="different envs"):
        pooled_change.pooled_change([result("eval", {0: [0], 180: [1]}), other])
