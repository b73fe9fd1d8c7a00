"""The algorithm interface and the actor-critic algorithms (IAC, MAAC) on a tiny model."""

import runpy
from pathlib import Path

import pytest
import torch
from gymnasium import spaces
from magrpo_fixtures import WordGameEnv, tiny_model_path  # noqa: F401 - pytest fixture

from magrpo.actor_critic import CRITICS_FILE, tree_advantages
from magrpo.algorithms import Algorithm, available_algorithms, register_algorithm
from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.env_contract import IncompatibleEnvError
from magrpo.rollout import JointOutcome, Node
from magrpo.trainer import MAGRPOTrainer

REPO = Path(__file__).resolve().parent.parent


class StateWordGameEnv(WordGameEnv):
    """The word game with PettingZoo's global state: both observations and both answers."""

    state_space = spaces.Text(max_length=1 << 16)

    def reset(self, seed=None, options=None):
        observations, infos = super().reset(seed, options)
        self.history = [f"{a} sees {o}" for a, o in observations.items()]
        return observations, infos

    def step(self, actions):
        result = super().step(actions)
        self.history += [f"{a} said {t}" for a, t in actions.items()]
        self.history += [f"{a} sees {o}" for a, o in result[0].items()]
        return result

    def state(self):
        return " ; ".join(self.history)


def make_trainer(model, algorithm, tmp_path, env=None, **changes):
    values = dict(
        model=model,
        algorithm=algorithm,
        output_dir=str(tmp_path / "run"),
        group_size=2,
        max_new_tokens=8,
        max_steps=2,
        learning_rate=1e-2,
        save_interval=0,
        eval_interval=0,
        progress_bar=False,
        env_workers=2,
    )
    values.update(changes)
    config = MAGRPOConfig(**values)
    env = env or StateWordGameEnv(max_turns=config.num_turns)
    return MAGRPOTrainer(config, env, model_resolver=str)


def test_the_registry_offers_magrpo_iac_and_maac():
    assert {"magrpo", "iac", "maac"} <= set(available_algorithms())
    with pytest.raises(ConfigError, match="algorithm='a2c'.*iac"):
        MAGRPOConfig(algorithm="a2c")


def test_actor_critic_needs_no_group_and_refuses_group_settings():
    MAGRPOConfig(algorithm="iac", group_size=1)  # its baseline is the critic, not the group
    with pytest.raises(ConfigError, match="group_size"):
        MAGRPOConfig(algorithm="magrpo", group_size=1)
    with pytest.raises(ConfigError, match="--algorithm iac computes its advantages"):
        MAGRPOConfig(algorithm="iac", advantage="rloo")


def test_gae_over_the_tree_matches_the_formula():
    """A two-turn tree by hand: joint 0 is expanded into a node with two leaf joints."""
    root = Node(0, 0, 0, None, ["a"], {"a": ""})
    root.joints = [
        JointOutcome((0,), reward=1.0, reward_parts={}, done=False, child=1, value=1.0 + 0.9 * 2.5),
        JointOutcome((1,), reward=3.0, reward_parts={}, done=True, terminated=True, value=5.7),
    ]
    child = Node(1, 0, 1, 0, ["a"], {"a": ""})
    child.joints = [
        JointOutcome((0,), reward=2.0, reward_parts={}, done=True, value=2.0),
        JointOutcome((1,), reward=3.0, reward_parts={}, done=True, value=3.0),
    ]
    values = {(0, "a"): 1.5, (1, "a"): 2.0}
    gamma, lam = 0.9, 0.5
    found = tree_advantages([root, child], values, gamma, lam)
    assert found[(1, "a")] == pytest.approx([0.0, 1.0])  # leaves: R - V
    expected = 1.0 + gamma * 2.0 - 1.5 + gamma * lam * 0.5
    assert found[(0, "a")] == pytest.approx([expected, 5.7 - 1.5])
    # lambda = 1: every advantage is the return minus the value
    monte_carlo = tree_advantages([root, child], values, gamma, 1.0)
    assert monte_carlo[(0, "a")] == pytest.approx([1.0 + 0.9 * 2.5 - 1.5, 5.7 - 1.5])


@pytest.mark.parametrize("algorithm", ["iac", "maac"])
def test_advantages_are_return_minus_value(tmp_path, tiny_model_path, algorithm):  # noqa: F811
    trainer = make_trainer(tiny_model_path, algorithm, tmp_path, num_turns=2)
    try:
        rollout = trainer.collect()
        samples, _ = trainer.build_samples(rollout)
        by_completion = {id(s.completion): s.advantage for s in samples}
        ac = trainer.algorithm
        checked = 0
        for node in rollout.nodes:
            for agent in node.agents:
                name, ids = ac.critic_input(node, agent)
                features = ac._features({(name, ids)})[(name, ids)]
                value = float(ac.critics[name].values(features[None])[0])
                for completion, ret in zip(
                    node.samples[agent], node.sample_returns[agent], strict=True
                ):
                    assert by_completion[id(completion)] == pytest.approx(ret - value, abs=1e-5)
                    checked += 1
        assert checked == len(samples) and rollout.num_turns_reached == 2
    finally:
        trainer.close()


@pytest.mark.parametrize("algorithm", ["iac", "maac"])
def test_the_critic_loss_goes_down_on_a_fixed_batch(tmp_path, tiny_model_path, algorithm):  # noqa: F811
    trainer = make_trainer(tiny_model_path, algorithm, tmp_path, group_size=1, prompts_per_step=4)
    try:
        rollout = trainer.collect()
        losses = []
        for _ in range(6):
            trainer.build_samples(rollout)  # the same rollout: fixed features and returns
            metrics = trainer.algorithm.update_extras(rollout)
            losses.append(sum(v for k, v in metrics.items() if k.startswith("critic/loss/")))
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        trainer.close()


def test_maac_critic_reads_the_state_and_agents_only_their_observations(
    tmp_path, tiny_model_path  # noqa: F811
):
    trainer = make_trainer(tiny_model_path, "maac", tmp_path, num_turns=2)
    try:
        rollout = trainer.collect()
        policies = trainer.policies
        first = policies.agents[0]
        for node in rollout.nodes:
            assert node.state.count(" sees ") >= 2  # both agents' observations
            for agent in node.agents:
                name, ids = trainer.algorithm.critic_input(node, agent)
                assert name == "central"
                assert list(ids) == policies.encode_prompt(first, node.state)
                for completion in node.samples[agent]:  # the agent's prompt: its observation
                    assert completion.prompt_ids == policies.encode_prompt(
                        agent, node.observations[agent]
                    )
            if node.turn == 1:
                assert " said " in node.state
                parent = rollout.nodes[node.parent]
                joint = next(j for j in parent.joints if j.child == node.node_id)
                for agent in node.agents:  # no agent sees another agent's answer or the state
                    other = next(a for a in node.agents if a != agent)
                    answer = parent.samples[other][joint.actions[node.agents.index(other)]].text
                    assert f"{other} said {answer}" in node.state
                    assert "said" not in node.observations[agent]
    finally:
        trainer.close()


def test_maac_needs_an_env_state(tmp_path, tiny_model_path):  # noqa: F811
    with pytest.raises(IncompatibleEnvError, match="state"):
        make_trainer(tiny_model_path, "maac", tmp_path, env=WordGameEnv())


def critic_weights(trainer):
    return {
        name: {k: v.clone() for k, v in critic.head.state_dict().items()}
        for name, critic in trainer.algorithm.critics.items()
    }


def test_critics_are_trained_checkpointed_resumed_and_saved(tmp_path, tiny_model_path):  # noqa: F811
    straight = make_trainer(tiny_model_path, "iac", tmp_path / "a", max_steps=4)
    try:
        initial = critic_weights(straight)
        straight.train()
        expected = critic_weights(straight)
    finally:
        straight.close()
    assert any(
        not torch.equal(initial[n][k], expected[n][k]) for n in initial for k in initial[n]
    )
    assert (tmp_path / "a" / "run" / "adapters" / CRITICS_FILE).is_file()

    first = make_trainer(tiny_model_path, "iac", tmp_path / "b", max_steps=2, save_interval=2)
    try:
        first.train()  # killed after step 2: the resumed run reads its checkpoint
    finally:
        first.close()
    resumed = make_trainer(tiny_model_path, "iac", tmp_path / "b", max_steps=4, resume=True)
    try:
        resumed.train()
        found = critic_weights(resumed)
    finally:
        resumed.close()
    for name in expected:
        for key in expected[name]:
            torch.testing.assert_close(found[name][key], expected[name][key])


def test_a_registered_algorithm_decides_advantages_and_loss(tmp_path, tiny_model_path):  # noqa: F811
    seen = {}

    @register_algorithm("test_constant")
    class Constant(Algorithm):
        def advantages(self, rollout):
            from magrpo.algorithms import TrainSample

            return [
                TrainSample(c, 1.0) for n in rollout.nodes for a in n.agents for c in n.samples[a]
            ], {"constant": 1.0}

        def token_loss(self, logprobs, advantages, old_logprobs, ref_logprobs):
            seen["advantages"] = advantages.tolist()
            return -logprobs, None

    trainer = make_trainer(tiny_model_path, "test_constant", tmp_path, max_steps=1)
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["constant"] == 1.0 and set(seen["advantages"]) == {1.0}


def test_third_party_example_trains(tmp_path, tiny_model_path):  # noqa: F811
    example = runpy.run_path(str(REPO / "examples" / "third_party_algorithm.py"))
    result = example["main"]([
        "--model", tiny_model_path, "--output-dir", str(tmp_path / "run"), "--group-size", "1",
        "--max-new-tokens", "8", "--no-progress-bar",
    ])  # fmt: skip
    assert result.steps == 2
    assert "baseline/concise" in result.history[-1]


@pytest.mark.parametrize("memory_option", ["reuse_sampled_states", "gradient_checkpointing"])
def test_critics_and_memory_options_get_along(tmp_path, tiny_model_path, memory_option):  # noqa: F811
    """The critics' feature pass runs between sampling and the update, where the memory
    options keep sampling's states: both speed-up modes give the same advantages."""
    advantages = {}
    for speedups in ("off", "auto"):
        options = {memory_option: True} if speedups == "auto" else {}
        trainer = make_trainer(
            tiny_model_path, "maac", tmp_path / speedups, speedups=speedups, **options
        )
        try:
            trainer.train_step()
            samples, _ = trainer.build_samples(trainer.collect())
            advantages[speedups] = [s.advantage for s in samples]
        finally:
            trainer.close()
    assert advantages["auto"] == pytest.approx(advantages["off"], abs=1e-4)
