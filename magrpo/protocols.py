"""The paper's inference-time protocols (docs/reference.md §4), over any PettingZoo text env.

A protocol turns the agents' observations into joint actions; the environment scores them.
Protocols read only the observations the env gives and the other agents' answers, and build
new prompt text from those; they never look inside the env, and they never score anything.

* ``parallel``: every agent answers its own observation independently (the untrained start).
* ``sequential``: agents answer in ``possible_agents`` order, each seeing the answers of the
  agents before it.
* ``discussion``: one round: every agent answers, sees the others' answers, and revises; the
  revised answers are the joint action.
* ``single``: one model reads every role's observation and writes all the parts in one
  response, each part after a delimiter line ``### <role>``; the response is split on those
  lines (a missing part is an empty answer). It gets ``max_new_tokens`` x number of roles.
  The prompt and the split are ``llm_marl_envs.wrappers.joint_text``'s, shared with the
  Gymnasium and TRL single-agent views, so every single-model baseline reads the same text.
* ``trained``: like ``parallel``, with the trained policies (adapters) of ``magrpo.train``.

Generation is batched: all the requests of a protocol phase (every problem, every sample,
every agent that acts in the phase) go into one ``Policies.sample`` call per model (split
into chunks of at most ``max_batch`` rows to bound memory). Timing: each call's wall-clock
time is shared among the agents in it in proportion to the tokens each generated; a phase's
latency is its slowest agent's share (agents of one phase run concurrently in a deployment,
one model each), and a protocol's latency is the sum over its phases (and turns).
``per_agent_timing=True`` makes one call per agent instead, so each agent's time is measured
directly rather than attributed.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from llm_marl_envs.wrappers.joint_text import combine_observations, split_response
from magrpo.metrics import Episode
from magrpo.policies import Policies, SamplingParams

PROTOCOLS = ("single", "parallel", "sequential", "discussion", "trained")
SINGLE_ROLE = "single"  # the timing key of the single model

JointAction = dict[str, str]


@dataclass(frozen=True)
class Actor:
    """Who writes a role's text: a policy set and the agent name to ask it for."""

    policies: Policies
    name: str


@dataclass
class ProtocolStats:
    """Time spent by one protocol run (seconds)."""

    latency: float = 0.0  # sum over phases of the slowest agent's generation time
    generation: float = 0.0  # wall-clock of all generate calls
    scoring: float = 0.0  # wall-clock of stepping the env copies
    generated_tokens: int = 0
    phases: int = 0
    calls: int = 0


@dataclass
class Generator:
    """Batched sampling with per-phase timing (see the module docstring)."""

    params: SamplingParams
    max_batch: int = 64
    per_agent_timing: bool = False
    stats: ProtocolStats = field(default_factory=ProtocolStats)
    on_call: Callable[[str], None] | None = None

    def phase(
        self,
        requests: Sequence[tuple[str, Actor, str]],
        num_samples: int,
        token_scale: int = 1,
    ) -> list[list[str]]:
        """Sample ``num_samples`` texts per (role, actor, prompt); one phase of a protocol."""
        params = replace(self.params, max_new_tokens=self.params.max_new_tokens * token_scale)
        results: list[list[str]] = [[] for _ in requests]
        groups: dict[Any, list[int]] = defaultdict(list)
        for index, (role, actor, _) in enumerate(requests):
            key = (id(actor.policies), role) if self.per_agent_timing else id(actor.policies)
            groups[key].append(index)
        role_seconds: dict[str, float] = defaultdict(float)
        per_call = max(1, self.max_batch // num_samples)
        for rows in groups.values():
            policies = requests[rows[0]][1].policies
            for start in range(0, len(rows), per_call):
                chunk = rows[start : start + per_call]
                if self.on_call is not None:
                    self.on_call(f"{len(chunk) * num_samples} rows")
                started = time.perf_counter()
                outputs = policies.sample(
                    [(requests[i][1].name, requests[i][2]) for i in chunk], num_samples, params
                )
                seconds = time.perf_counter() - started
                self.stats.generation += seconds
                self.stats.calls += 1
                tokens: dict[str, int] = defaultdict(int)
                for i, completions in zip(chunk, outputs, strict=True):
                    results[i] = [c.text for c in completions]
                    tokens[requests[i][0]] += sum(len(c.completion_ids) for c in completions)
                total = sum(tokens.values())
                self.stats.generated_tokens += total
                for role, count in tokens.items():
                    share = count / total if total else 1 / len(tokens)
                    role_seconds[role] += seconds * share
        self.stats.latency += max(role_seconds.values(), default=0.0)
        self.stats.phases += 1
        return results


# --- prompts built from observations and answers ---------------------------------------------


def _answers_block(answers: Mapping[str, str]) -> str:
    return "\n\n".join(f"[{role}]\n{text.strip()}" for role, text in answers.items())


def sequential_prompt(observation: str, previous: Mapping[str, str]) -> str:
    return (
        f"{observation}\n\nYour teammates have already written their parts:\n\n"
        f"{_answers_block(previous)}\n\nWrite your own part so that it fits with theirs. "
        "Output only your part."
    )


def revision_prompt(observation: str, own: str, others: Mapping[str, str]) -> str:
    return (
        f"{observation}\n\nYour first answer:\n{own.strip()}\n\nYour teammates' first answers:"
        f"\n\n{_answers_block(others)}\n\nRevise your answer so that it works well together with "
        "your teammates' parts. Output only your revised part."
    )


# --- the protocols: observations of C contexts -> `count` joint actions per context ----------

ProtocolFn = Callable[
    [Sequence[Mapping[str, str]], int, Generator, Mapping[str, Actor], Actor | None],
    list[list[JointAction]],
]


def _independent(contexts, count, generator, actors) -> list[list[JointAction]]:
    requests = [(role, actors[role], ctx[role]) for ctx in contexts for role in ctx]
    texts = iter(generator.phase(requests, count))
    joints: list[list[JointAction]] = []
    for ctx in contexts:
        per_role = {role: next(texts) for role in ctx}
        joints.append([{role: per_role[role][g] for role in ctx} for g in range(count)])
    return joints


def parallel(contexts, count, generator, actors, single_actor=None) -> list[list[JointAction]]:
    return _independent(contexts, count, generator, actors)


def sequential(contexts, count, generator, actors, single_actor=None) -> list[list[JointAction]]:
    joints: list[list[JointAction]] = [[{} for _ in range(count)] for _ in contexts]
    roles = list(contexts[0]) if contexts else []
    for position, role in enumerate(roles):
        if position == 0:
            texts = generator.phase([(role, actors[role], ctx[role]) for ctx in contexts], count)
            for c, samples in enumerate(texts):
                for g in range(count):
                    joints[c][g][role] = samples[g]
            continue
        requests = [
            (role, actors[role], sequential_prompt(ctx[role], joints[c][g]))
            for c, ctx in enumerate(contexts)
            for g in range(count)
        ]
        texts = iter(generator.phase(requests, 1))
        for c in range(len(contexts)):
            for g in range(count):
                joints[c][g][role] = next(texts)[0]
    return joints


def discussion(contexts, count, generator, actors, single_actor=None) -> list[list[JointAction]]:
    first = _independent(contexts, count, generator, actors)
    requests = [
        (
            role,
            actors[role],
            revision_prompt(
                ctx[role], first[c][g][role], {o: first[c][g][o] for o in ctx if o != role}
            ),
        )
        for c, ctx in enumerate(contexts)
        for g in range(count)
        for role in ctx
    ]
    texts = iter(generator.phase(requests, 1))
    return [[{role: next(texts)[0] for role in ctx} for _ in range(count)] for ctx in contexts]


def single(contexts, count, generator, actors, single_actor=None) -> list[list[JointAction]]:
    if single_actor is None:
        raise ValueError("the single protocol needs a single model (single_actor)")
    requests = [(SINGLE_ROLE, single_actor, combine_observations(ctx)) for ctx in contexts]
    texts = generator.phase(requests, count, token_scale=len(contexts[0]) if contexts else 1)
    return [
        [split_response(text, list(ctx)) for text in samples]
        for ctx, samples in zip(contexts, texts, strict=True)
    ]


PROTOCOL_FUNCTIONS: dict[str, ProtocolFn] = {
    "single": single,
    "parallel": parallel,
    "sequential": sequential,
    "discussion": discussion,
    "trained": parallel,
}


# --- running a protocol on an env --------------------------------------------------------------


def _step(env: Any, actions: JointAction):
    observations, rewards, terminations, truncations, infos = env.step(actions)
    reward = sum(float(rewards[a]) for a in actions) / max(len(actions), 1)
    first = next(iter(actions))
    info = dict(infos.get(first) or {})
    done = not getattr(env, "agents", None) or all(
        terminations.get(a, False) or truncations.get(a, False) for a in actions
    )
    return env, observations, reward, info, done


def run_protocol(
    protocol: str,
    env: Any,
    problems: Sequence[tuple[int | None, int]],
    actors: Mapping[str, Actor],
    generator: Generator,
    executor: Executor,
    num_samples: int,
    *,
    single_actor: Actor | None = None,
    on_scored: Callable[[int], None] | None = None,
) -> list[Episode]:
    """Play ``num_samples`` episodes per problem with ``protocol``; the env scores each turn.

    ``problems``: (dataset index or None, reset seed). Turn 1 draws ``num_samples`` joint
    actions per problem (each on its own ``copy.deepcopy`` of the reset env); later turns
    (``max_turns`` > 1) apply the protocol again, once, to every unfinished episode's new
    observations. Branches are stepped concurrently on ``executor``. ``on_scored(1)`` is
    called as each episode ends (for a progress bar).
    """
    function = PROTOCOL_FUNCTIONS[protocol]
    roots, contexts = [], []
    for index, seed in problems:
        observations, _ = env.reset(seed=seed, options=None if index is None else {"index": index})
        roots.append(copy.deepcopy(env))
        contexts.append({a: str(observations[a]) for a in env.agents})
    episodes = [Episode(p, g) for p in range(len(problems)) for g in range(num_samples)]
    live = [
        (episodes[p * num_samples + g], roots[p], p)
        for p in range(len(problems))
        for g in range(num_samples)
    ]
    count, first_turn = num_samples, True
    while live:
        joints = function(contexts, count, generator, actors, single_actor)
        started = time.perf_counter()
        jobs = []
        for position, (episode, branch, context_index) in enumerate(live):
            actions = joints[context_index][position % count if first_turn else 0]
            branch = copy.deepcopy(branch) if first_turn else branch
            episode.actions.append(actions)
            jobs.append((episode, executor.submit(_step, branch, actions)))
        next_live, next_contexts = [], []
        for episode, future in jobs:
            branch, observations, reward, info, done = future.result()
            episode.rewards.append(reward)
            episode.reward_parts.append(
                {str(k): float(v) for k, v in (info.get("reward_parts") or {}).items()}
            )
            episode.infos = info
            if done and on_scored is not None:
                on_scored(1)
            if not done:
                next_live.append((episode, branch, len(next_contexts)))
                next_contexts.append({a: str(observations[a]) for a in branch.agents})
        generator.stats.scoring += time.perf_counter() - started
        live, contexts, count, first_turn = next_live, next_contexts, 1, False
    return episodes
