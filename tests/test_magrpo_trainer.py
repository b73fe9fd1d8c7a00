"""The training loop end to end on a tiny model and a tiny env: files, isolation, resume."""

import json
from pathlib import Path

import pytest
import torch
from gymnasium import spaces
from magrpo_fixtures import WordGameEnv, tiny_model_path  # noqa: F401 - pytest fixture

from magrpo.checkpoint import latest_checkpoint, list_checkpoints
from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.env_contract import IncompatibleEnvError
from magrpo.rollout import Completion
from magrpo.speedups.auto import keeps_freed_memory
from magrpo.trainer import MAGRPOTrainer, TrainSample


def make_config(output_dir, model, **changes) -> MAGRPOConfig:
    values = dict(
        model=model,
        output_dir=str(output_dir),
        group_size=4,
        max_new_tokens=10,
        max_steps=4,
        learning_rate=1e-2,
        save_interval=2,
        eval_interval=2,
        eval_size=2,
        progress_bar=False,
        env_workers=4,
    )
    values.update(changes)
    return MAGRPOConfig(**values)


def run(config, env=None, eval_env=None):
    trainer = MAGRPOTrainer(
        config, env or WordGameEnv(max_turns=config.num_turns), eval_env, model_resolver=str
    )
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def trainable(trainer):
    return {
        agent: {
            n: p.detach().clone()
            for n, p in trainer.policies.named_trainable_parameters(agent).items()
        }
        for agent in trainer.agents
    }


def test_train_writes_metrics_checkpoints_and_adapters(tmp_path, tiny_model_path):  # noqa: F811
    config = make_config(tmp_path / "run", tiny_model_path, num_turns=2)
    trainer, result = run(config, eval_env=WordGameEnv(max_turns=2))
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    baseline, first = records[0], records[1]
    assert "eval/reward/mean" in baseline and "reward/mean" not in baseline  # before training
    for key in (
        "reward/mean", "reward/std", "turn2/reward/mean", "reward_parts/vowels", "loss",
        "grad_norm/alice", "completion_length/bob", "zero_variance_group_frac",
        "tokens_per_second", "time/generate", "time/update", "return/mean",
    ):  # fmt: skip
        assert key in first, key
    assert "eval/reward/mean" in records[2] and "eval/reward/mean" not in records[1]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-2", "step-4"]
    for agent in ("alice", "bob"):
        assert (tmp_path / "run" / "adapters" / agent / "adapter_model.safetensors").is_file()
    assert result.steps == 4 and result.best_reward >= result.last_reward - 1e-9
    assert json.loads((tmp_path / "run" / "config.json").read_text())["group_size"] == 4


@pytest.mark.parametrize(
    "changes",
    [{}, {"finetune": "full", "optimizer_in_backward": True, "max_grad_norm": None}],
    ids=["lora", "full-optimizer-in-backward"],
)
def test_resume_is_bit_identical(tmp_path, tiny_model_path, changes):  # noqa: F811
    def config(name, **more):
        return make_config(tmp_path / name, tiny_model_path, **changes, **more)

    straight, _ = run(config("a", max_steps=4, save_interval=0))
    run(config("b", max_steps=2, save_interval=2))
    resumed, _ = run(config("b", max_steps=4, resume=True))
    expected, got = trainable(straight), trainable(resumed)
    for agent in expected:
        for name in expected[agent]:
            assert torch.equal(expected[agent][name], got[agent][name]), name
    metrics_a = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    metrics_b = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    rewards = [
        [json.loads(x)["reward/mean"] for x in m if "reward/mean" in json.loads(x)]
        for m in (metrics_a, metrics_b)
    ]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 4


def test_half_written_checkpoint_is_ignored(tmp_path):
    from magrpo.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, 2, {"step": 2})
    partial = tmp_path / "checkpoints" / ".tmp-step-3-999"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"trunc")
    assert latest_checkpoint(tmp_path).name == "step-2"


def test_one_agent_update_leaves_the_other_untouched(tmp_path, tiny_model_path):  # noqa: F811
    config = make_config(tmp_path / "iso", tiny_model_path)
    trainer = MAGRPOTrainer(config, WordGameEnv(), model_resolver=str)
    # LoRA on CPU gives freed memory back unless told to keep it (magrpo.speedups.heap)
    assert [keeps_freed_memory(p, trainer.policies) for p in ("auto", "keep", "release")] == [
        False, True, False,
    ]  # fmt: skip
    before = trainable(trainer)
    prompt = trainer.policies.encode_prompt("alice", "say words")
    samples = [
        TrainSample(Completion("alice", "", prompt, [10, 11, 2], True), 0.0),
        TrainSample(Completion("alice", "", prompt, [12, 2], True), 0.0),
        TrainSample(Completion("bob", "", prompt, [13, 14, 2], True), 1.0),
        TrainSample(Completion("bob", "", prompt, [15, 2], True), -1.0),
    ]
    trainer.update(samples)
    after = trainable(trainer)
    assert all(torch.equal(before["alice"][n], after["alice"][n]) for n in before["alice"])
    assert any(not torch.equal(before["bob"][n], after["bob"][n]) for n in before["bob"])
    trainer.close()


def test_full_finetune_cross_clip_kl(tmp_path, tiny_model_path):  # noqa: F811
    config = make_config(
        tmp_path / "full", tiny_model_path, finetune="full", joint_mode="cross", group_size=2,
        clip_epsilon=0.2, num_update_epochs=2, kl_coef=0.1, loss_type="token_mean",
        advantage="rloo", normalize_advantage_std=True, max_steps=2, eval_interval=0,
    )  # fmt: skip
    trainer, result = run(config)
    assert len(trainer.policies.models) == 2
    assert keeps_freed_memory("auto", trainer.policies)  # full fine-tuning keeps it
    assert not keeps_freed_memory("auto", trainer.policies, saving_memory=True)
    assert not keeps_freed_memory("release", trainer.policies)
    record = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kl"] >= 0.0
    assert (tmp_path / "full" / "models" / "alice" / "config.json").is_file()


@pytest.mark.usefixtures("torch_threads")  # the trainers set 2 threads; restored after
def test_models_sampled_side_by_side_train_as_one_at_a_time(tmp_path, tiny_model_path):  # noqa: F811
    """Full fine-tuning on 2 threads: the two models decoding side by side (the default)
    draw the same samples as one after the other, so training ends at the same weights."""
    weights = {}
    for side_by_side in (True, False):
        config = make_config(
            tmp_path / str(side_by_side), tiny_model_path, finetune="full", max_steps=2,
            eval_interval=0, save_interval=0, torch_threads=2, sample_side_by_side=side_by_side,
        )  # fmt: skip
        trainer, _ = run(config)
        assert trainer.policies.speedups.side_by_side is side_by_side
        weights[side_by_side] = trainable(trainer)
    for agent, params in weights[True].items():
        for name, value in params.items():
            assert torch.equal(value, weights[False][agent][name]), (agent, name)
    alice, bob = weights[True]["alice"], weights[True]["bob"]
    assert any(not torch.equal(alice[n], bob[n]) for n in alice)  # trained: no longer equal


def test_memory_savers_train_to_the_same_weights(tmp_path, tiny_model_path):  # noqa: F811
    """Full fine-tuning with activation checkpointing and the optimizer stepped inside the
    backward (two micro-batches per model: the first accumulates, the last steps; the
    log-prob passes in turn; the weights' memory reused by their packed decode copies) ends
    at the weights of the plain update, bit for bit."""
    weights = {}
    for saving in (False, True):
        config = make_config(
            tmp_path / str(saving), tiny_model_path, finetune="full", max_steps=2,
            eval_interval=0, save_interval=0, max_grad_norm=None, micro_batch_size=2,
            gradient_checkpointing=saving, optimizer_in_backward=saving,
        )  # fmt: skip
        trainer, _ = run(config)
        speedups = trainer.policies.speedups
        assert speedups.gradient_checkpointing is saving
        assert bool(speedups._backward_steps) is saving
        assert speedups.passes_in_turn is speedups.reuse_weight_memory is saving
        weights[saving] = trainable(trainer)
    for agent, params in weights[False].items():
        for name, value in params.items():
            assert torch.equal(weights[True][agent][name], value), (agent, name)


@pytest.mark.parametrize("epochs", [1, 2])
def test_reused_sampled_states_train_as_the_ordinary_pass(
    tmp_path,
    tiny_model_path,  # noqa: F811
    monkeypatch,
    epochs,
):
    """The update starts from sampling's layer inputs in its first epoch only (the weights
    have changed after it), each weight stepped inside the layer-by-layer backward; one
    step ends where the ordinary pass's does, up to AdamW's first step on gradients equal up
    to rounding (sign(g) * lr, so a near-zero gradient's rounding may move it by < lr / 4)."""
    import magrpo.policies
    import magrpo.speedups.auto

    calls = {"from states": 0, "log-prob passes": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(
        magrpo.speedups.auto,
        "final_hidden_from_states",
        counted("from states", magrpo.speedups.auto.final_hidden_from_states),
    )
    monkeypatch.setattr(
        magrpo.policies.Policies,
        "logprobs",
        counted("log-prob passes", magrpo.policies.Policies.logprobs),
    )
    lr = 1e-2
    weights = {}
    for reuse in (False, True):
        config = make_config(
            tmp_path / str(reuse), tiny_model_path, finetune="full", max_steps=1,
            eval_interval=0, save_interval=0, max_grad_norm=None, micro_batch_size=2,
            learning_rate=lr, optimizer_in_backward=True, reuse_sampled_states=reuse,
            num_update_epochs=epochs, clip_epsilon=0.2 if epochs > 1 else None,
        )  # fmt: skip
        calls.update({"from states": 0, "log-prob passes": 0})
        trainer, _ = run(config)
        assert trainer.policies.speedups.sampled_states is None  # dropped after the first epoch
        passes = calls["log-prob passes"]
        assert passes >= 2 * epochs  # two agents, one micro-batch or more each
        assert calls["from states"] == (passes // epochs if reuse else 0)
        weights[reuse] = trainable(trainer)
    for agent, params in weights[False].items():
        for name, value in params.items():
            torch.testing.assert_close(weights[True][agent][name], value, rtol=0, atol=lr / 4)


def test_epochs_and_data_order(tmp_path, tiny_model_path):  # noqa: F811
    config = make_config(
        tmp_path / "ep", tiny_model_path, max_steps=None, num_epochs=1, prompts_per_step=2,
        eval_interval=0, save_interval=0, max_new_tokens=4,
    )  # fmt: skip
    trainer, result = run(config, env=WordGameEnv(num_items=6))
    assert result.steps == 3  # 6 items / 2 per step
    assert trainer.data_order.epoch == 1 and trainer.data_order.position == 0


class NumberEnv(WordGameEnv):
    def observation_space(self, agent):
        return spaces.Discrete(3)


def test_non_text_env_is_rejected(tmp_path):
    with pytest.raises(IncompatibleEnvError, match="gymnasium.spaces.Text"):
        MAGRPOTrainer(make_config(tmp_path, "unused"), NumberEnv(), model_resolver=str)


def test_unloadable_model_is_a_clear_error(tmp_path):
    from magrpo.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="--model"):
        MAGRPOTrainer(
            make_config(tmp_path, str(tmp_path / "missing")), WordGameEnv(), model_resolver=str
        )


def test_example_custom_algorithm_runs(tmp_path, tiny_model_path):  # noqa: F811
    import runpy

    pytest.importorskip("llm_marl_envs", exc_type=ImportError)
    example = Path(__file__).resolve().parents[1] / "examples" / "custom_algorithm.py"
    module = runpy.run_path(str(example))
    result = module["main"](
        [
            "--model",
            tiny_model_path,
            "--output-dir",
            str(tmp_path / "ex"),
            "--max-steps",
            "2",
            "--max-new-tokens",
            "6",
        ]
    )
    assert result.steps == 2


def test_cli_reports_user_errors_in_one_paragraph(capsys, tmp_path):
    pytest.importorskip("llm_marl_envs", exc_type=ImportError)
    from magrpo.train import main

    assert main(["--env", "no-such-env", "--output-dir", str(tmp_path)]) == 2
    assert "Known environments" in capsys.readouterr().err
    assert main(["--group-size", "0"]) == 2
    assert "group_size=0" in capsys.readouterr().err
    missing = ["--env", "tldr", "--data", str(tmp_path / "missing.jsonl")]
    assert main([*missing, "--output-dir", str(tmp_path)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_vllm_backend_without_vllm_is_one_clear_error(capsys, tmp_path, tiny_model_path):  # noqa: F811
    from magrpo.train import main

    args = ["--env", "tldr", "--data", str(Path(__file__).parent / "data" / "tldr_sample.jsonl")]
    args += ["--model", tiny_model_path, "--output-dir", str(tmp_path), "--max-steps", "1"]
    code = main([*args, "--generation-backend", "vllm"])
    if code == 0:
        pytest.skip("vllm and a GPU are available: the backend ran")
    assert code == 2
    error = capsys.readouterr().err
    assert "--generation-backend hf" in error and "pip install" in error


def test_agent_devices_place_separate_models(tmp_path, tiny_model_path):  # noqa: F811
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]
    config = make_config(
        tmp_path / "devices", tiny_model_path, finetune="full", agent_devices=devices,
        max_steps=1, eval_interval=0, group_size=2, joint_mode="aligned",
    )  # fmt: skip
    trainer, result = run(config)
    assert result.steps == 1
    for backend, device in zip(trainer.policies.models, devices, strict=True):
        assert {p.device for p in backend.model.parameters()} == {torch.device(device)}
    for agent, device in zip(trainer.agents, devices, strict=True):
        state = trainer.optimizers[agent].state_dict()["state"]
        assert state and all(
            s["exp_avg"].device == torch.device(device) for s in state.values()
        )  # optimizer states follow their agent


def test_agent_devices_errors(tmp_path, tiny_model_path):  # noqa: F811
    from magrpo.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="one shared base"):  # LoRA: one base, one device
        run(make_config(tmp_path / "a", tiny_model_path, agent_devices=["cpu", "meta"]))
    with pytest.raises(ConfigError, match="one per agent"):
        run(make_config(tmp_path / "b", tiny_model_path, agent_devices=["cpu"]))
    with pytest.raises(ConfigError, match="not a torch device"):
        run(make_config(tmp_path / "c", tiny_model_path, agent_devices=["cpu", "gpu7"]))


def test_heterogeneous_models_with_lora_and_kl(tmp_path, tiny_model_path):  # noqa: F811
    from magrpo_fixtures import build_tiny_model

    other = str(build_tiny_model(tmp_path / "other-model", seed=1))
    config = make_config(
        tmp_path / "het", tiny_model_path, models=[tiny_model_path, other], kl_coef=0.1,
        max_steps=1, eval_interval=0, group_size=2,
    )  # fmt: skip
    trainer, _ = run(config)
    assert [b.mode for b in trainer.policies.models] == ["lora", "lora"]
    record = json.loads((tmp_path / "het" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kl"] >= 0.0
    for agent in ("alice", "bob"):
        assert (tmp_path / "het" / "adapters" / agent / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    ("folder", "loader"),
    [("models", "AutoModelForCausalLM.from_pretrained"), ("adapters", "PeftModel.from_pretrained")],
)
def test_summary_names_how_to_load_what_was_saved(capsys, tmp_path, folder, loader):
    from magrpo.train import print_summary
    from magrpo.trainer import TrainResult

    result = TrainResult(tmp_path, 2, 0.5, 0.7, None, tmp_path / folder, tmp_path / "m.jsonl")
    print_summary(result, 61.0)
    out = capsys.readouterr().out
    assert f"{tmp_path / folder}/<agent>" in out and loader in out and "1m01s" in out
