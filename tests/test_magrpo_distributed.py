"""Data-parallel MAGRPO: 2 CPU processes (torchrun, gloo) train like 1 process on the same batch.

The real CLI is launched, as a user would: ``python -m torch.distributed.run --nproc-per-node 2
-m magrpo.train ...``. Both runs see the same global batch (2 episodes per step), so the
metrics, checkpoints and final adapters must agree within float tolerance; a 2-process run
killed after step 2 and resumed must end where the uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from magrpo_fixtures import tiny_model_path  # noqa: F401 - pytest fixture

from magrpo.distributed import local_launcher

DATA = Path(__file__).parent / "data" / "tldr_sample.jsonl"
LR = 0.05
COMPARED = ("reward/mean", "reward/std", "loss", "trained_sequences", "eval/reward/mean")


def _train(model: str, output: Path, processes: int, *extra: str) -> subprocess.CompletedProcess:
    launcher = local_launcher(processes)
    command = [
        *launcher,
        "-m",
        "magrpo.train",
        "--env=tldr",
        f"--data={DATA}",
        f"--model={model}",
        "--prompts-per-step=2",
        "--group-size=3",
        "--max-new-tokens=8",
        f"--learning-rate={LR}",
        "--eval-interval=1",
        "--eval-size=3",  # 3 eval items over 2 processes: uneven shares are gathered
        "--save-interval=1",
        "--save-total-limit=3",
        "--torch-threads=1",
        "--no-progress-bar",
        f"--output-dir={output}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def _metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(output: Path, step: int) -> dict:
    return torch.load(output / "checkpoints" / f"step-{step}" / "state.pt", weights_only=False)


def _assert_same_training_state(want: dict, have: dict, moments_rtol: float) -> None:
    """Adam's moments are running sums of gradients: after one step they agree to float
    precision (measured: 2e-6 relative to each tensor's largest entry).

    Later steps and the weights are compared more loosely: Adam moves each weight by about
    lr * g / (|g| + eps), which turns float noise in a near-zero gradient into a visible
    weight difference (measured: up to 0.04 lr after one step), and the next gradients
    inherit it.
    """
    for agent, state in want["optimizers"].items():
        for key, moments in state["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                expected, got = moments[name], have["optimizers"][agent]["state"][key][name]
                scale = float(expected.abs().max())
                error = float((got - expected).abs().max())
                assert error <= moments_rtol * scale + 1e-12, (agent, key, name, error, scale)
        for name, value in want["weights"][agent].items():
            torch.testing.assert_close(have["weights"][agent][name], value, rtol=0, atol=0.1 * LR)


def _check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path):  # noqa: F811
    root = tmp_path_factory.mktemp("dp")
    single, parallel = root / "single", root / "parallel"
    _check(_train(tiny_model_path, single, 1, "--max-steps=3"))
    _check(_train(tiny_model_path, parallel, 2, "--max-steps=2"))  # "killed" after step 2
    first_leg = _metrics(parallel), _checkpoint(parallel, 1)
    resumed = _train(tiny_model_path, parallel, 2, "--max-steps=3", "--resume")
    _check(resumed)
    return single, parallel, first_leg, resumed


def test_two_processes_match_one_process_on_the_same_global_batch(runs):
    single, parallel, (got, step_one), _ = runs
    _assert_same_training_state(_checkpoint(single, 1), step_one, moments_rtol=1e-4)
    _assert_same_training_state(_checkpoint(single, 2), _checkpoint(parallel, 2), 0.05)
    expected = _metrics(single)
    assert [r["step"] for r in got] == [0, 1, 2]  # metrics are written once, not per process
    assert sum(r.get("trained_sequences", 0) for r in expected) > 0  # the run did learn
    for want, have in zip(expected, got, strict=False):
        for key in COMPARED:
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (key, want)
        for key in [k for k in want if k.startswith("grad_norm/")]:
            assert have[key] == pytest.approx(want[key], rel=1e-3), key


def test_resumed_two_process_run_ends_where_the_uninterrupted_run_ends(runs):
    single, parallel, _, resumed = runs
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in _metrics(parallel)] == [0, 1, 2, 3]
    for key in COMPARED:
        want = _metrics(single)[3].get(key)
        if want is not None:
            assert _metrics(parallel)[3][key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    want, have = _checkpoint(single, 3), _checkpoint(parallel, 3)
    _assert_same_training_state(want, have, moments_rtol=0.05)
    assert have["step"] == 3 and have["data_order"] == want["data_order"]
    trained = [v for w in have["weights"].values() for n, v in w.items() if "lora_B" in n]
    assert any(bool(v.abs().sum() > 0) for v in trained)  # LoRA B starts at zero
    assert {p.parent.name for p in (parallel / "adapters").glob("*/adapter_config.json")} == {
        "concise",
        "detailed",
    }


def test_checkpoints_are_written_once(runs):
    _, parallel, _, _ = runs
    checkpoints = sorted(p.name for p in (parallel / "checkpoints").iterdir())
    assert checkpoints == ["step-1", "step-2", "step-3"]  # no per-process copies or temp dirs


def test_global_batch_must_divide_over_processes(tmp_path, tiny_model_path):  # noqa: F811
    result = _train(tiny_model_path, tmp_path / "odd", 2, "--max-steps=1", "--prompts-per-step=3")
    assert result.returncode != 0
    assert "multiple of the 2 training processes" in result.stderr
