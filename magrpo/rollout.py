"""Tree rollouts over any PettingZoo ParallelEnv with text observations and actions.

For each episode root, every agent samples G completions from its observation; joint
actions are formed (aligned: sample g of every agent, G joints; cross: the Cartesian
product, G^N joints); each joint action is stepped on its own deep copy of the env (the
copies are stepped concurrently). With several turns, each joint action whose episode is
still running becomes a child node that samples a fresh group from that branch's next
observations. Returns: R_j = r_j + discount * mean(returns of the child's joints).
All nodes of one depth, over all roots, are sampled in one batched call.

A joint that ends the episode early by solving it (the env terminates it) or that is not
expanded (early termination) keeps its reward for every turn left in the horizon:
R_j = r_j * (1 + discount + ... + discount^(turns left)). Without this, a solve at turn 1
(R = r) is worth less than a partial answer followed by a solve (r' + discount * r), since
every reward is >= 0, and the group baseline would push agents away from solving early. The
authors' library hides this with a constant reward shift; the value of staying solved needs
no tuned constant. A branch that the env truncates has no turns left.

Randomness: given ``root_seeds``, every request carries a seed derived from its root's seed
and its path in the tree (joint index, agent), so a tree's samples do not depend on which
other trees share the batch: one process or many, the same episodes get the same samples.

The result is plain records (``Node``, ``JointOutcome``, ``Completion``); advantages and
losses are computed elsewhere.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Completion:
    """One sampled answer of one agent."""

    agent: str
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the first EOS; no padding
    finished: bool  # True when it ended with EOS (False: cut at max_new_tokens)


@dataclass
class JointOutcome:
    """One joint action of a node (``actions[i]`` = sample index of agent i) and its result."""

    actions: tuple[int, ...]
    reward: float
    reward_parts: dict[str, float]
    done: bool
    terminated: bool = False  # the env ended the episode before its horizon (e.g. solved)
    child: int | None = None
    value: float = float("nan")  # the return R_j, filled by compute_returns


@dataclass
class Node:
    """One group: the G samples of every acting agent at one observation of one branch."""

    node_id: int
    root: int
    turn: int
    parent: int | None
    agents: list[str]
    observations: dict[str, str]
    samples: dict[str, list[Completion]] = field(default_factory=dict)
    joints: list[JointOutcome] = field(default_factory=list)
    sample_returns: dict[str, list[float]] = field(default_factory=dict)
    seed: int | None = None  # its samples' randomness (None: torch's global generator)
    state: str | None = None  # env.state() here, when the rollout records it (record_state)


@dataclass
class RolloutResult:
    nodes: list[Node]
    num_roots: int
    seconds_generate: float = 0.0
    seconds_env: float = 0.0
    generated_tokens: int = 0

    def nodes_at_turn(self, turn: int) -> list[Node]:
        return [node for node in self.nodes if node.turn == turn]

    @property
    def num_turns_reached(self) -> int:
        return 1 + max(node.turn for node in self.nodes)


# sample_fn(requests=[(agent, observation), ...], num_samples, seeds=[int, ...] | None)
#   -> one list of samples per request
SampleFn = Callable[[Sequence[tuple[str, str]], int, Sequence[int] | None], list[list[Completion]]]


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (a tree path, a sample index, ...)."""
    return int(
        np.random.SeedSequence([int(p) % 2**63 for p in parts]).generate_state(2, np.uint64)[0] >> 1
    )


def joint_actions(num_agents: int, group_size: int, joint_mode: str) -> list[tuple[int, ...]]:
    if joint_mode == "aligned":
        return [(g,) * num_agents for g in range(group_size)]
    if joint_mode == "cross":
        return list(itertools.product(range(group_size), repeat=num_agents))
    raise ValueError(f"unknown joint_mode {joint_mode!r} (aligned | cross)")


def _step_branch(
    env: Any, actions: dict[str, str]
) -> tuple[Any, dict, float, dict, bool, bool]:
    branch = copy.deepcopy(env)
    observations, rewards, terminations, truncations, infos = branch.step(actions)
    reward = float(np.mean([float(rewards[a]) for a in actions])) if rewards else 0.0
    parts: dict[str, float] = {}
    for agent in actions:
        found = (infos.get(agent) or {}).get("reward_parts")
        if found:
            parts = {str(k): float(v) for k, v in found.items()}
            break
    done = not branch.agents or all(
        terminations.get(a, False) or truncations.get(a, False) for a in actions
    )
    terminated = done and not any(truncations.get(a, False) for a in actions)
    return branch, observations, reward, parts, done, terminated


def run_rollout(
    root_envs: Sequence[Any],
    root_observations: Sequence[dict[str, str]],
    sample_fn: SampleFn,
    executor: Executor,
    *,
    group_size: int,
    joint_mode: str = "aligned",
    num_turns: int = 1,
    discount: float = 1.0,
    early_termination_threshold: float | None = None,
    root_seeds: Sequence[int] | None = None,
    record_state: bool = False,
) -> RolloutResult:
    """Expand the rollout tree of every root (an env right after ``reset``).

    ``record_state``: keep every node's ``env.state()`` (PettingZoo's global state) in
    ``Node.state``, for centralised critics; the agents never see it."""
    nodes: list[Node] = []
    frontier: list[tuple[Node, Any]] = []
    for root, (env, observations) in enumerate(zip(root_envs, root_observations, strict=True)):
        agents = list(env.agents)
        node = Node(len(nodes), root, 0, None, agents, {a: observations[a] for a in agents})
        if record_state:
            node.state = str(env.state())
        if root_seeds is not None:
            node.seed = derive_seed(root_seeds[root])
        nodes.append(node)
        frontier.append((node, env))
    result = RolloutResult(nodes, len(root_envs))

    while frontier:
        requests = [(a, node.observations[a]) for node, _ in frontier for a in node.agents]
        seeds = None
        if root_seeds is not None:
            seeds = [
                derive_seed(node.seed, i) for node, _ in frontier for i in range(len(node.agents))
            ]
        started = time.perf_counter()
        groups = iter(sample_fn(requests, group_size, seeds))
        result.seconds_generate += time.perf_counter() - started
        for node, _ in frontier:
            for agent in node.agents:
                node.samples[agent] = next(groups)
                result.generated_tokens += sum(len(c.completion_ids) for c in node.samples[agent])

        started = time.perf_counter()
        jobs = []
        for node, env in frontier:
            for actions in joint_actions(len(node.agents), group_size, joint_mode):
                texts = {
                    a: node.samples[a][g].text for a, g in zip(node.agents, actions, strict=True)
                }
                jobs.append((node, actions, executor.submit(_step_branch, env, texts)))
        next_frontier: list[tuple[Node, Any]] = []
        pending: dict[int, list[tuple[JointOutcome, Any, dict]]] = {}
        for node, actions, future in jobs:
            branch, observations, reward, parts, done, terminated = future.result()
            outcome = JointOutcome(actions, reward, parts, done, terminated)
            node.joints.append(outcome)
            pending.setdefault(node.node_id, []).append((outcome, branch, observations))
        result.seconds_env += time.perf_counter() - started

        for node, _ in frontier:
            mean_reward = float(np.mean([j.reward for j in node.joints]))
            expand = node.turn + 1 < num_turns and not (
                early_termination_threshold is not None
                and mean_reward > early_termination_threshold
            )
            if not expand:
                continue
            for joint, (outcome, branch, observations) in enumerate(pending[node.node_id]):
                if outcome.done:
                    continue
                agents = list(branch.agents)
                child = Node(
                    len(nodes),
                    node.root,
                    node.turn + 1,
                    node.node_id,
                    agents,
                    {a: observations[a] for a in agents},
                    seed=None if node.seed is None else derive_seed(node.seed, -1, joint),
                    state=str(branch.state()) if record_state else None,
                )
                outcome.child = child.node_id
                nodes.append(child)
                next_frontier.append((child, branch))
        frontier = next_frontier

    compute_returns(nodes, discount, num_turns)
    return result


def compute_returns(nodes: list[Node], discount: float, num_turns: int = 1) -> None:
    """Fill ``JointOutcome.value`` bottom-up and each agent's credited ``sample_returns``.

    Children always have larger ids than their parents, so one reverse pass suffices.
    An agent's sample is credited with the mean return over the joints that contain it
    (aligned mode: exactly one joint). A leaf before the horizon that the env did not
    truncate keeps its reward for the turns left (see the module docstring).
    """
    for node in reversed(nodes):
        turns_left = num_turns - 1 - node.turn
        for outcome in node.joints:
            if outcome.child is not None:
                child_values = [j.value for j in nodes[outcome.child].joints]
                outcome.value = outcome.reward + discount * float(np.mean(child_values))
            elif outcome.done and not outcome.terminated:
                outcome.value = outcome.reward  # truncated: the episode has no turns left
            else:
                outcome.value = outcome.reward * sum(discount**k for k in range(turns_left + 1))
        node.sample_returns = {
            agent: credit(node, index, [j.value for j in node.joints])
            for index, agent in enumerate(node.agents)
        }


def credit(node: Node, index: int, per_joint: Sequence[float]) -> list[float]:
    """Per sample of the node's ``index``-th agent: the mean of ``per_joint`` (one value per
    joint action) over the joints that contain that sample (aligned mode: exactly one)."""
    group = len(node.samples[node.agents[index]])
    totals = [0.0] * group
    counts = [0] * group
    for outcome, value in zip(node.joints, per_joint, strict=True):
        totals[outcome.actions[index]] += value
        counts[outcome.actions[index]] += 1
    return [t / max(c, 1) for t, c in zip(totals, counts, strict=True)]


def rollout_metrics(rollout: RolloutResult) -> dict[str, float]:
    """Joint reward mean/std per turn, return of the first turn, every reward part's mean."""
    metrics: dict[str, float] = {}
    for turn in range(rollout.num_turns_reached):
        joints = [j for node in rollout.nodes_at_turn(turn) for j in node.joints]
        rewards = np.array([j.reward for j in joints])
        prefix = "reward" if turn == 0 else f"turn{turn + 1}/reward"
        metrics[f"{prefix}/mean"] = float(rewards.mean())
        metrics[f"{prefix}/std"] = float(rewards.std())
        parts: dict[str, list[float]] = defaultdict(list)
        for joint in joints:
            for name, value in joint.reward_parts.items():
                parts[name].append(value)
        part_prefix = "reward_parts" if turn == 0 else f"turn{turn + 1}/reward_parts"
        for name, values in parts.items():
            metrics[f"{part_prefix}/{name}"] = float(np.mean(values))
    metrics["return/mean"] = float(
        np.mean([j.value for n in rollout.nodes_at_turn(0) for j in n.joints])
    )
    metrics["num_nodes"] = float(len(rollout.nodes))
    return metrics
