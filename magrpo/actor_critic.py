"""Actor-critic algorithms: IAC (one critic per agent) and MAAC (one centralised critic).

Both replace MAGRPO's group baseline by a learned value V, so they also learn with one
sample per agent (``group_size`` 1), as the authors' library runs them.

**The critic** is a value head (LayerNorm, Linear, Tanh, Linear) on the last hidden state of
a policy's model at the last token of the critic's input, computed without gradients: the
critic learns on the trunk's features and never moves the actor. The authors' library
(CoMLRL) trains a whole language model with a value head as its critic; a head on the
policy's features costs one prompt forward per node and fits a CPU budget.

- **IAC**: agent i's critic reads agent i's own observation through agent i's own policy.
- **MAAC**: one critic reads the env's ``state()`` (every agent's observations, actions and
  results so far: centralised training) through the first agent's model, and every agent's
  advantage uses it. The agents still act on their own observations only.

**Advantages**: GAE over the rollout tree, for each agent with its critic's V. For joint
action j of node n, whose expanded branch is node c (its joints k):

    A_j = r_j + gamma * V(c) - V(n) + gamma * lambda * mean_k A_k      (expanded)
    A_j = R_j - V(n)                                                    (a leaf, R_j its return)

With lambda = 1 every A_j equals R_j - V(n), the return minus the value. A sample's advantage
is the mean of A_j over the joints that contain it, as its return is (``rollout.credit``).
The critic then regresses V(n) on V(n) + mean_j A_j (the TD(lambda) return: with lambda = 1,
the node's mean return), for ``critic_steps`` AdamW steps per rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from magrpo.algorithms import Algorithm, TrainSample, register_algorithm
from magrpo.rollout import Node, RolloutResult, credit

CRITICS_FILE = "critics.pt"


class ValueHead(nn.Module):
    """V(features): a small MLP on a model's hidden state."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(features), nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)


class Critic:
    """A value head, the agent whose model computes its features, and its optimizer."""

    def __init__(self, reader: str, features: int, config: Any, device: torch.device):
        self.reader = reader
        self.features = features
        self.head = ValueHead(features, config.critic_hidden_size).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.critic_learning_rate)

    def no_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.head.parameters()).device
        return torch.zeros(0, self.features, device=device), torch.zeros(0, device=device)

    def values(self, features: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.head(features)

    def fit(self, features: torch.Tensor, targets: torch.Tensor, steps: int, parallel) -> float:
        """``steps`` AdamW steps on the squared error over every process's (features, target)
        pairs; returns the mean squared error before the first step."""
        count = parallel.sum([len(targets)])[0]
        params = list(self.head.parameters())
        first = float("nan")
        for step in range(steps):
            loss = ((self.head(features) - targets) ** 2).sum() / max(count, 1)
            loss.backward()
            if step == 0:
                first = parallel.sum([float(loss.detach())])[0]
            if parallel.sum_gradients(params):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return first


def tree_advantages(
    nodes: Sequence[Node],
    values: dict[tuple[int, str], float],
    discount: float,
    gae_lambda: float,
) -> dict[tuple[int, str], list[float]]:
    """GAE of every joint action of every node, per agent (see the module docstring):
    ``values[(node_id, agent)]`` is V of that agent's critic at the node; the result maps
    (node_id, agent) to one advantage per joint of the node. Children come after their
    parents, so one reverse pass suffices; needs the returns (``compute_returns``)."""
    advantages: dict[tuple[int, str], list[float]] = {}
    for node in reversed(nodes):
        for agent in node.agents:
            value = values[(node.node_id, agent)]
            joint_advantages = []
            for outcome in node.joints:
                child = (outcome.child, agent)
                if outcome.child is None or child not in advantages:
                    joint_advantages.append(outcome.value - value)
                    continue
                bootstrap = float(np.mean(advantages[child]))
                joint_advantages.append(
                    outcome.reward
                    + discount * values[child]
                    - value
                    + discount * gae_lambda * bootstrap
                )
            advantages[(node.node_id, agent)] = joint_advantages
    return advantages


class ActorCritic(Algorithm):
    """Policy gradient with a learned baseline; subclasses say what each critic reads."""

    def __init__(self, config: Any, policies: Any, parallel: Any):
        super().__init__(config, policies, parallel)
        self.critics = {
            name: Critic(reader, policies.feature_size(reader), config,
                         policies.model_of[reader].device)
            for name, reader in self.critic_readers().items()
        }  # fmt: skip
        for critic in self.critics.values():
            parallel.broadcast_parameters(critic.head.parameters())
        self._fit: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- what the critics read (the subclasses) ---------------------------------------------
    def critic_readers(self) -> dict[str, str]:
        """Critic name -> the agent whose model computes that critic's features."""
        raise NotImplementedError

    def critic_input(self, node: Node, agent: str) -> tuple[str, tuple[int, ...]]:
        """The critic that values ``agent`` at ``node``, and the token ids it reads."""
        raise NotImplementedError

    # --- the algorithm ----------------------------------------------------------------------
    def advantages(self, rollout: RolloutResult) -> tuple[list[TrainSample], dict[str, float]]:
        inputs = {
            (node.node_id, agent): self.critic_input(node, agent)
            for node in rollout.nodes
            for agent in node.agents
        }
        features = self._features(set(inputs.values()))
        value_of = self._values(features)
        values = {key: value_of[found] for key, found in inputs.items()}
        joint_advantages = tree_advantages(
            rollout.nodes, values, self.config.discount, self.config.gae_lambda
        )
        samples: list[TrainSample] = []
        # per critic and node: its features and its TD(lambda) target; a critic that several
        # agents share (MAAC) gets the same target from each of them, and keeps one
        fit: dict[str, dict[int, tuple[torch.Tensor, float]]] = {n: {} for n in self.critics}
        for node in rollout.nodes:
            for index, agent in enumerate(node.agents):
                key = (node.node_id, agent)
                sample_advantages = credit(node, index, joint_advantages[key])
                samples.extend(
                    TrainSample(c, a)
                    for c, a in zip(node.samples[agent], sample_advantages, strict=True)
                )
                target = values[key] + float(np.mean(joint_advantages[key]))
                fit[inputs[key][0]][node.node_id] = (features[inputs[key]], target)
        self._fit = {}
        for name, rows in fit.items():
            if rows:
                stacked = torch.stack([f for f, _ in rows.values()])
                wanted = torch.tensor([t for _, t in rows.values()], device=stacked.device)
                self._fit[name] = (stacked, wanted)
        totals = self.parallel.sum(
            [len(values), sum(values.values()), sum(s.advantage for s in samples), len(samples)]
        )
        return samples, {
            "critic/value_mean": totals[1] / max(totals[0], 1),
            "critic/advantage_mean": totals[2] / max(totals[3], 1),
        }

    def _features(self, inputs: set[tuple[str, tuple[int, ...]]]) -> dict:
        """(critic, token ids) -> the critic's input features, batched per critic."""
        features = {}
        for name, critic in self.critics.items():
            prompts = sorted(ids for n, ids in inputs if n == name)
            for start in range(0, len(prompts), self.config.micro_batch_size):
                chunk = prompts[start : start + self.config.micro_batch_size]
                rows = self.policies.prompt_features(critic.reader, [list(p) for p in chunk])
                features.update({(name, p): row for p, row in zip(chunk, rows, strict=True)})
        return features

    def _values(self, features: dict) -> dict[tuple[str, tuple[int, ...]], float]:
        """(critic, token ids) -> that critic's value, one head pass per critic."""
        values = {}
        for name, critic in self.critics.items():
            keys = [key for key in features if key[0] == name]
            if keys:
                found = critic.values(torch.stack([features[key] for key in keys]))
                values.update(zip(keys, found.tolist(), strict=True))
        return values

    def update_extras(self, rollout: RolloutResult) -> dict[str, float]:
        metrics = {}
        for name, critic in self.critics.items():
            features, targets = self._fit.get(name) or critic.no_data()  # (all join the sums)
            metrics[f"critic/loss/{name}"] = critic.fit(
                features, targets, self.config.critic_steps, self.parallel
            )
        self._fit = {}
        return metrics

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            name: {"head": c.head.state_dict(), "optimizer": c.optimizer.state_dict()}
            for name, c in self.critics.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [name for name in self.critics if name not in state]
        if missing:
            raise ValueError(
                f"The checkpoint has no critic {missing}: it was written by a run of another "
                f"algorithm than {self.config.algorithm!r}. Resume with that run's --algorithm."
            )
        for name, critic in self.critics.items():
            critic.head.load_state_dict(state[name]["head"])
            critic.optimizer.load_state_dict(state[name]["optimizer"])

    def save(self, directory: Path) -> None:
        heads = {name: c.head.state_dict() for name, c in self.critics.items()}
        torch.save(
            {"algorithm": self.config.algorithm, "readers": self.critic_readers(), "heads": heads},
            Path(directory) / CRITICS_FILE,
        )


@register_algorithm("iac")
class IAC(ActorCritic):
    """Independent actor-critic: agent i's critic values agent i's own observation."""

    def critic_readers(self) -> dict[str, str]:
        return {agent: agent for agent in self.policies.agents}

    def critic_input(self, node: Node, agent: str) -> tuple[str, tuple[int, ...]]:
        return agent, tuple(node.samples[agent][0].prompt_ids)  # what the agent sampled from


@register_algorithm("maac")
class MAAC(ActorCritic):
    """Multi-agent actor-critic with one centralised critic that values ``env.state()``."""

    reads_state = True

    def critic_readers(self) -> dict[str, str]:
        return {"central": self.policies.agents[0]}

    def critic_input(self, node: Node, agent: str) -> tuple[str, tuple[int, ...]]:
        if node.state is None:
            raise ValueError(
                "MAAC's critic reads env.state(), but the rollout recorded none: the env must "
                "implement PettingZoo's state() (every llm_marl_envs env does)."
            )
        return "central", tuple(self.policies.encode_prompt(self.policies.agents[0], node.state))
