"""End to end with the real default model (SmolLM2) and a real task: slow, still run in CI."""

import json
from pathlib import Path

import pytest

SHARED = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "coophumaneval" / "coophumaneval.json"
)


@pytest.mark.slow
def test_cli_trains_smollm2_on_coophumaneval_and_resumes(tmp_path):
    pytest.importorskip("llm_marl_envs", exc_type=ImportError)
    if not SHARED.exists():
        pytest.skip(f"CoopHumanEval test data not found at {SHARED}")
    from magrpo.models import ModelNotFoundError, resolve_model
    from magrpo.train import main

    try:
        resolve_model(None)
    except ModelNotFoundError as error:
        pytest.skip(str(error))
    flags = [
        "--env", "coophumaneval", "--data", str(SHARED), "--max-new-tokens", "16",
        "--group-size", "2", "--eval-interval", "2", "--eval-size", "1", "--save-interval", "1",
        "--output-dir", str(tmp_path), "--no-progress-bar",
    ]  # fmt: skip
    assert main([*flags, "--max-steps", "1"]) == 0
    assert main([*flags, "--max-steps", "2", "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the untrained agents' eval
    assert "eval/reward/mean" in records[0] and "reward/mean" not in records[0]
    assert "reward_parts/syntax" in records[1] and "eval/reward/mean" in records[2]
    for agent in ("aux", "main"):
        assert (tmp_path / "adapters" / agent / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_cli_trains_smollm2_on_tldr_sample_data(tmp_path):
    from magrpo.checkpoint import list_checkpoints
    from magrpo.models import ModelNotFoundError, resolve_model
    from magrpo.train import main

    try:
        resolve_model(None)
    except ModelNotFoundError as error:
        pytest.skip(str(error))
    data = Path(__file__).parent / "data" / "tldr_sample.jsonl"
    flags = [
        "--env", "tldr", "--data", str(data), "--max-new-tokens", "16", "--group-size", "2",
        "--max-steps", "2", "--eval-interval", "2", "--eval-size", "2", "--save-interval", "1",
        "--output-dir", str(tmp_path), "--no-progress-bar",
    ]  # fmt: skip
    assert main(flags) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "reward_parts/structure" in records[1] and "eval/reward/mean" in records[2]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1", "step-2"]
    for agent in ("concise", "detailed"):
        assert (tmp_path / "adapters" / agent / "adapter_model.safetensors").is_file()
