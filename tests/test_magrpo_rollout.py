"""Tree rollouts with a scripted sampler: joints, credited returns, discount, termination."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from magrpo_fixtures import WordGameEnv

from magrpo.rollout import Completion, joint_actions, run_rollout

# sample g of each agent, whatever the observation
SCRIPT = {"alice": ["apple egg", "bat cat"], "bob": ["one two three", "dog"]}
# WordGameEnv.score: vowel-initial fraction of alice's words + 0.5 if bob has more words
#   (a0,b0) = 1.0 + 0.5 = 1.5   (a0,b1) = 1.0   (a1,b0) = 0.5   (a1,b1) = 0.0


def scripted_sampler(calls=None, seeds_seen=None):
    def sample(requests, num_samples, seeds=None):
        if calls is not None:
            calls.append(list(requests))
        if seeds_seen is not None:
            seeds_seen.append(seeds)
        return [
            [Completion(agent, SCRIPT[agent][g], [1], [2], True) for g in range(num_samples)]
            for agent, _ in requests
        ]

    return sample


def rollout(env, **kwargs):
    observations, _ = env.reset(seed=0, options={"index": 0})
    with ThreadPoolExecutor(4) as pool:
        return run_rollout([env], [observations], scripted_sampler(), pool, group_size=2, **kwargs)


def test_joint_actions():
    assert joint_actions(2, 3, "aligned") == [(0, 0), (1, 1), (2, 2)]
    assert len(joint_actions(2, 3, "cross")) == 9
    assert joint_actions(3, 2, "cross")[:2] == [(0, 0, 0), (0, 0, 1)]


def test_aligned_single_turn():
    result = rollout(WordGameEnv())
    (node,) = result.nodes
    assert [j.reward for j in node.joints] == [1.5, 0.0]
    assert node.sample_returns == {"alice": [1.5, 0.0], "bob": [1.5, 0.0]}
    assert node.joints[0].reward_parts == {"vowels": 1.0, "longer": 0.5}


def test_cross_credits_mean_over_joints_containing_sample():
    result = rollout(WordGameEnv(), joint_mode="cross")
    (node,) = result.nodes
    assert [j.reward for j in node.joints] == [1.5, 1.0, 0.5, 0.0]
    assert node.sample_returns["alice"] == [1.25, 0.25]
    assert node.sample_returns["bob"] == [1.0, 0.5]


def test_multi_turn_returns_with_discount():
    result = rollout(WordGameEnv(max_turns=2), num_turns=2, discount=0.5)
    root = result.nodes[0]
    children = result.nodes_at_turn(1)
    assert len(children) == 2 and all(c.parent == 0 for c in children)
    # each child sees the same scripted samples: child joint rewards [1.5, 0], mean 0.75
    assert [j.value for j in children[0].joints] == [1.5, 0.0]
    assert [j.value for j in root.joints] == [1.5 + 0.5 * 0.75, 0.0 + 0.5 * 0.75]
    assert root.sample_returns["alice"] == [1.875, 0.375]
    assert "again" in children[0].observations["alice"]  # next-turn observation of the branch


def test_tree_of_three_turns_has_g_cubed_leaves():
    result = rollout(WordGameEnv(max_turns=3), num_turns=3, discount=1.0)
    assert [len(result.nodes_at_turn(t)) for t in range(3)] == [1, 2, 4]
    assert result.nodes[0].joints[0].value == pytest.approx(1.5 + 0.75 + 0.75)


def test_early_termination_and_finished_episodes_are_leaves():
    stopped = rollout(WordGameEnv(max_turns=2), num_turns=2, early_termination_threshold=0.7)
    assert len(stopped.nodes) == 1  # mean reward 0.75 > 0.7: not expanded
    # not expanded: each joint keeps its reward for the turn left (discount 1)
    assert stopped.nodes[0].sample_returns["alice"] == [3.0, 0.0]
    ended = rollout(WordGameEnv(max_turns=1), num_turns=2)
    assert len(ended.nodes) == 1  # the env ended every branch


def test_one_sampling_call_per_depth_over_all_roots():
    calls = []
    envs, observations = [], []
    for index in range(3):
        env = WordGameEnv(max_turns=2)
        observations.append(env.reset(seed=index, options={"index": index})[0])
        envs.append(env)
    with ThreadPoolExecutor(4) as pool:
        result = run_rollout(
            envs, observations, scripted_sampler(calls), pool, group_size=2, num_turns=2
        )
    assert len(calls) == 2  # depth 0 (3 roots) and depth 1 (6 children), batched
    assert len(calls[0]) == 3 * 2 and len(calls[1]) == 6 * 2
    assert result.num_roots == 3 and len(result.nodes) == 9
    assert calls[0][0] == ("alice", "say words alice")


def test_request_seeds_depend_on_the_tree_not_on_the_batch():
    """Seeded requests: a tree gets the same seeds alone or batched with others (sharding)."""

    def seeds_of(root_seeds, num_roots=None):
        envs, observations = [], []
        for _ in range(num_roots or len(root_seeds)):
            env = WordGameEnv(max_turns=2)
            observations.append(env.reset(seed=0, options={"index": 0})[0])
            envs.append(env)
        seen = []
        with ThreadPoolExecutor(4) as pool:
            run_rollout(
                envs,
                observations,
                scripted_sampler(seeds_seen=seen),
                pool,
                group_size=2,
                num_turns=2,
                root_seeds=root_seeds,
            )
        return seen

    together = seeds_of([11, 22])
    alone = [seeds_of([11]), seeds_of([22])]
    # turn 1: 2 agents per root; turn 2: 2 children per root, 2 agents each
    assert together[0] == alone[0][0] + alone[1][0]
    assert together[1] == alone[0][1] + alone[1][1]
    every = [seed for call in together for seed in call]
    assert len(set(every)) == len(every)  # every (node, agent) draws its own stream
    assert seeds_of(None, num_roots=1) == [None, None]  # unseeded: torch's global generator


class SolveEnv(WordGameEnv):
    """HumanEval's numbers: a full solve scores 2.5 and ends the episode, anything else 1.1."""

    def step(self, actions):
        solved = all(text == "solve" for text in actions.values())
        reward = 2.5 if solved else 1.1
        self.turn += 1
        over = solved or self.turn >= self.max_turns
        observations = {a: f"turn {self.turn}" for a in self.agents}
        infos = {a: {"reward_parts": {"score": reward}} for a in self.agents}
        terminations = {a: solved for a in self.agents}
        truncations = {a: over and not solved for a in self.agents}
        if over:
            self.agents = []
        return observations, {a: reward for a in actions}, terminations, truncations, infos


def solve_sampler(requests, num_samples, seeds=None):
    """Turn 1: sample 0 solves, sample 1 is partial. Turn 2: every sample solves."""
    return [
        [
            Completion(agent, "solve" if g == 0 or obs.startswith("turn") else "partial", [1], [2],
                       True)
            for g in range(num_samples)
        ]
        for agent, obs in requests
    ]


@pytest.mark.parametrize("joint_mode", ["aligned", "cross"])
def test_a_turn_one_solve_is_worth_at_least_a_partial_answer_then_a_solve(joint_mode):
    env = SolveEnv(max_turns=2)
    observations, _ = env.reset(options={"index": 0})
    with ThreadPoolExecutor(2) as pool:
        result = run_rollout([env], [observations], solve_sampler, pool, group_size=2,
                             joint_mode=joint_mode, num_turns=2, discount=0.9)
    root = result.nodes[0]
    values = {joint.actions: joint.value for joint in root.joints}
    solve_now = values[(0, 0)]
    assert solve_now == pytest.approx(2.5 * (1 + 0.9))  # stays solved for the turn left
    partial_then_solve = values[(1, 1)]
    assert partial_then_solve == pytest.approx(1.1 + 0.9 * 2.5)  # 3.35
    assert solve_now >= partial_then_solve
    for returns in root.sample_returns.values():
        assert returns[0] > returns[1]  # the sample that solved at once is credited more


def test_a_truncated_branch_has_no_turns_left():
    env = SolveEnv(max_turns=1)  # the env ends every episode after one turn
    observations, _ = env.reset(options={"index": 0})
    with ThreadPoolExecutor(2) as pool:
        result = run_rollout([env], [observations], solve_sampler, pool, group_size=2,
                             num_turns=2, discount=0.9)
    values = [joint.value for joint in result.nodes[0].joints]
    assert values == pytest.approx([2.5 * 1.9, 1.1])
