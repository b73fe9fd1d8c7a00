"""A third-party algorithm that lives outside the package and trains through its interface.

REINFORCE with a moving-average baseline per agent: A = R - b_agent, where b_agent follows
the agent's mean return over the steps (b <- decay * b + (1 - decay) * mean R). It needs no
group, so it also trains with one sample per agent (``--group-size 1``), and its baselines
are state that checkpoints keep and a resumed run restores::

    python examples/third_party_algorithm.py                  # SmolLM2, TLDR sample data
    python examples/third_party_algorithm.py --model path/to/tiny --max-steps 2

The pattern: subclass ``magrpo.algorithms.Algorithm``, register it by name, and pass
``--algorithm`` that name. The trainer keeps the rollout, sampling, the policies' optimizers,
checkpoints, logging and the speed-ups. Any ``MAGRPOConfig`` flag works here too.
"""

from __future__ import annotations

import sys
from pathlib import Path

from magrpo.algorithms import Algorithm, TrainSample, register_algorithm
from magrpo.config import config_from_args
from magrpo.train import train

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "tldr_sample.jsonl"


@register_algorithm("moving_average_baseline")
class MovingAverageBaseline(Algorithm):
    """A = R - b_agent, with b_agent a moving average of the agent's mean return."""

    decay = 0.9

    def __init__(self, config, policies, parallel):
        super().__init__(config, policies, parallel)
        self.baselines: dict[str, float] = {}  # an agent's baseline, from its first step on

    def advantages(self, rollout):
        samples, sums = [], {}
        for node in rollout.nodes:
            for agent in node.agents:
                baseline = self.baselines.get(agent, 0.0)
                returns = node.sample_returns[agent]
                samples += [
                    TrainSample(completion, value - baseline)
                    for completion, value in zip(node.samples[agent], returns, strict=True)
                ]
                total, count = sums.get(agent, (0.0, 0))
                sums[agent] = (total + sum(returns), count + len(returns))
        for agent in self.policies.agents:  # every process folds in every process's returns
            total, count = self.parallel.sum(sums.get(agent, (0.0, 0)))
            if count:
                mean = total / count
                old = self.baselines.get(agent, mean)
                self.baselines[agent] = self.decay * old + (1 - self.decay) * mean
        return samples, {f"baseline/{agent}": b for agent, b in self.baselines.items()}

    def state_dict(self):
        return {"baselines": dict(self.baselines)}

    def load_state_dict(self, state):
        self.baselines = dict(state["baselines"])


def main(argv: list[str] | None = None):
    defaults = [
        "--env", "tldr",
        "--data", str(SAMPLE_DATA),
        "--algorithm", "moving_average_baseline",
        "--group-size", "2",
        "--max-steps", "2",
        "--max-new-tokens", "32",
        "--eval-interval", "0",
        "--output-dir", "runs/third_party_algorithm",
    ]  # fmt: skip
    config = config_from_args(defaults + list(sys.argv[1:] if argv is None else argv))
    return train(config)


if __name__ == "__main__":
    main()
