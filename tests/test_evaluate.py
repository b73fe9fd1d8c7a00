"""magrpo.evaluate: estimators, protocols, every protocol on every env, loading trained agents,
metrics taken from the env's reward parts, the table, the charts and the CLI's user errors."""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import DATA
from magrpo_fixtures import WordGameEnv, tiny_model_path  # noqa: F401 - pytest fixture

import llm_marl_envs
from llm_marl_envs.wrappers.joint_text import split_response
from magrpo import evaluate as ev
from magrpo.loading import load_policies
from magrpo.metrics import best_at_k, compute_metrics, pass_at_k
from magrpo.plot import main as plot_main
from magrpo.plot import plot_training
from magrpo.policies import SamplingParams
from magrpo.protocols import (
    PROTOCOLS,
    Actor,
    Generator,
    run_protocol,
)
from magrpo.rollout import Completion

# --- estimators -------------------------------------------------------------------------------


@pytest.mark.parametrize("n,c", [(5, 0), (5, 2), (6, 6), (7, 3)])
def test_pass_at_k_is_the_subset_probability(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        exact = sum(max(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_best_at_k_is_the_expected_subset_maximum():
    scores = [0.2, 0.0, 1.0, 0.6, 0.6, 0.4]
    for k in range(1, len(scores) + 1):
        subsets = list(itertools.combinations(scores, k))
        assert best_at_k(scores, k) == pytest.approx(sum(map(max, subsets)) / len(subsets))
    assert best_at_k([0, 1, 1, 0], 2) == pytest.approx(pass_at_k(4, 2, 2))
    with pytest.raises(ValueError):
        best_at_k([1.0], 2)


# --- fake policies: canned answers, recorded prompts -----------------------------------------


class CannedPolicies:
    """Answers by role, read from the prompt; records every (name, prompt) it is asked."""

    def __init__(self, answer, delay_per_token: float = 0.0):
        self.answer = answer
        self.delay = delay_per_token
        self.calls: list[list[tuple[str, str]]] = []

    def sample(self, requests, num_samples, params):
        self.calls.append(list(requests))
        out = []
        tokens = 0
        for name, prompt in requests:
            group = []
            for g in range(num_samples):
                text = self.answer(name, prompt, g)
                ids = list(range(len(text.split()) or 1))
                tokens += len(ids)
                group.append(Completion(name, text, [0], ids, True))
            out.append(group)
        time.sleep(self.delay * tokens)
        return out


AUX = "def aux(text):\n    return sum(1 for ch in text.lower() if ch in 'aeiou')\n"
MAIN = "def count_vowels(text):\n    if not text:\n        return 0\n    return aux(text)\n"
WRONG = "def count_vowels(text):\n    return -1\n"


def coding_answer(name, prompt, sample):
    helper = prompt.startswith("You are the helper") or name == "aux"
    if "### aux" in prompt:  # the single protocol's combined prompt
        return f"### aux\n{AUX}\n### main\n{MAIN if sample % 2 == 0 else WRONG}"
    return AUX if helper else (MAIN if sample % 2 == 0 else WRONG)


def coding_env(max_turns=1):
    return llm_marl_envs.make(
        "coophumaneval", data=DATA / "coding_sample.jsonl", split="all", max_turns=max_turns
    )


def play(protocol, env, policies, samples=4, problems=((0, 0),), per_agent=False):
    actor = Actor(policies, "x")
    actors = {a: Actor(policies, a) for a in env.possible_agents}
    generator = Generator(SamplingParams(8), per_agent_timing=per_agent)
    with ThreadPoolExecutor(4) as pool:
        episodes = run_protocol(
            protocol, env, list(problems), actors, generator, pool, samples, single_actor=actor
        )
    return episodes, generator


def test_protocols_score_canned_answers_through_the_env():
    policies = CannedPolicies(coding_answer)
    env = coding_env()
    for protocol in PROTOCOLS:
        episodes, _ = play(protocol, env, policies)
        assert [e.sample for e in episodes] == [0, 1, 2, 3]
        if protocol in ("parallel", "trained", "single"):
            # samples 0, 2 pass every test; 1, 3 return -1 and pass none
            passed = [e.infos["tests_passed"] == e.infos["tests_total"] for e in episodes]
            assert passed == [True, False, True, False]
        metrics = compute_metrics(episodes, [1, 2, 4])
        # env-reported: reward == sum of reward_parts, metrics from those parts
        for e in episodes:
            assert e.rewards[0] == pytest.approx(sum(e.reward_parts[0].values()))
        if protocol != "sequential" and protocol != "discussion":
            assert metrics["pass@1"] == pytest.approx(0.5)
            assert metrics["pass@4"] == pytest.approx(1.0)
            assert metrics["pass@2"] == pytest.approx(pass_at_k(4, 2, 2))
            assert metrics["cooperation_rate"] == pytest.approx(0.5)


def test_sequential_discussion_single_prompts_carry_the_other_answers():
    env = coding_env()
    observations, _ = env.reset(options={"index": 0})

    policies = CannedPolicies(coding_answer)
    play("sequential", env, policies, samples=2)
    first, second = policies.calls
    assert first == [("aux", observations["aux"])]
    assert len(second) == 2 and all(name == "main" for name, _ in second)
    assert all(p.startswith(observations["main"]) and AUX.strip() in p for _, p in second)

    policies = CannedPolicies(coding_answer)
    play("discussion", env, policies, samples=2)
    first, revise = policies.calls
    assert sorted(first) == sorted([("aux", observations["aux"]), ("main", observations["main"])])
    assert len(revise) == 4  # 2 samples x 2 agents, one batched call
    main_prompt = next(p for name, p in revise if name == "main")
    assert "Your first answer" in main_prompt and AUX.strip() in main_prompt

    policies = CannedPolicies(coding_answer)
    play("single", env, policies, samples=2)
    ((name, prompt),) = policies.calls[0]
    assert name == "x" and observations["aux"] in prompt and observations["main"] in prompt


def test_split_single():
    text = "intro\n### aux\ndef aux(): return 1\n## `main`:\ndef f(): return aux()\n### aux\nx"
    assert split_response(text, ["aux", "main"]) == {
        "aux": "def aux(): return 1",
        "main": "def f(): return aux()",
    }
    assert split_response("no markers at all", ["aux", "main"]) == {"aux": "", "main": ""}


def test_one_generate_call_per_phase_and_time_attribution():
    env = coding_env()
    policies = CannedPolicies(coding_answer, delay_per_token=0.004)
    _, generator = play("parallel", env, policies, samples=3, problems=((0, 0), (1, 1), (2, 2)))
    assert len(policies.calls) == 1 and len(policies.calls[0]) == 6  # 3 problems x 2 agents
    stats = generator.stats
    # main's answers have more tokens than aux's: its share is the phase latency
    assert stats.phases == 1 and 0.5 * stats.generation < stats.latency < stats.generation
    policies = CannedPolicies(coding_answer, delay_per_token=0.004)
    _, generator = play("parallel", env, policies, samples=3, per_agent=True)
    assert len(policies.calls) == 2  # one call per agent: each agent's time measured
    assert generator.stats.latency < generator.stats.generation


def test_multi_turn_episodes_continue_from_the_env_observations():
    env = coding_env(max_turns=2)
    policies = CannedPolicies(coding_answer)
    episodes, _ = play("parallel", env, policies, samples=2)
    solved, failed = episodes
    assert len(solved.rewards) == 1  # solved: the env terminated the episode
    assert len(failed.rewards) == 2
    second_turn = policies.calls[1]
    assert len(second_turn) == 2 and "Feedback" in second_turn[0][1]
    metrics = compute_metrics(episodes, [1, 2], max_turns=2)
    assert metrics["return"] == pytest.approx((solved.total_return + failed.total_return) / 2)
    assert metrics["reward/turn2"] == pytest.approx(failed.rewards[1])


class PatchedEnv:
    """Wraps an env and rewrites what it reports: metrics must follow the env, not the text."""

    def __init__(self, env, parts, extra):
        self.env, self.parts, self.extra = env, parts, extra
        self.possible_agents = env.possible_agents
        self.num_items = env.num_items

    @property
    def agents(self):
        return self.env.agents

    def reset(self, seed=None, options=None):
        return self.env.reset(seed=seed, options=options)

    def step(self, actions):
        observations, rewards, terminations, truncations, infos = self.env.step(actions)
        total = sum(self.parts.values())
        for agent in infos:
            infos[agent] = {**infos[agent], "reward_parts": dict(self.parts), **self.extra}
        return observations, dict.fromkeys(rewards, total), terminations, truncations, infos

    def __deepcopy__(self, memo):
        return PatchedEnv(copy.deepcopy(self.env, memo), self.parts, self.extra)


def test_metrics_come_from_the_env_reward_parts_not_from_the_text():
    coding = {"aux_structure": 0.4, "main_structure": 0.6, "syntax": 0.5, "tests": 0.3,
              "cooperation": 0.5}  # fmt: skip
    env = PatchedEnv(coding_env(), coding, {"tests_passed": 1, "tests_total": 1})
    episodes, _ = play("parallel", env, CannedPolicies(coding_answer), samples=2)
    metrics = compute_metrics(episodes, [1])
    assert metrics["tests"] == pytest.approx(0.3)  # the env said 0.3, whatever the code did
    assert metrics["pass@1"] == 1.0  # from the env's tests_passed/tests_total
    assert metrics["cooperation"] == pytest.approx(0.5 / 1.5)
    assert metrics["return"] == pytest.approx(sum(coding.values()))

    writing = {"structure": 0.5, "length": 0.25, "vocabulary": 0.5, "coherence": 0.1,
               "consistency": 0.3}  # fmt: skip
    tldr = llm_marl_envs.make("tldr", data=DATA / "tldr_sample.jsonl")
    env = PatchedEnv(tldr, writing, {"length_ratio": 7.0})
    episodes, _ = play("parallel", env, CannedPolicies(lambda n, p, g: "a b c"), samples=2)
    metrics = compute_metrics(episodes, [1])
    assert metrics["structure"] == pytest.approx(1.25 / 2.0)
    assert metrics["coherence"] == pytest.approx(0.25)
    assert metrics["consistency"] == pytest.approx(0.5)
    assert metrics["length_ratio"] == 7.0
    assert metrics["return_norm"] == pytest.approx(1.65 / 3.0)


# --- real tiny models on every env -----------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_path):  # noqa: F811
    """A run folder as magrpo.train leaves it: config.json + adapters/<agent> per env's agents."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for agents in (["concise", "detailed"], ["background", "method"], ["aux", "main"]):
        run = root / agents[0]
        torch.manual_seed(1)
        policies = load_policies(agents, [tiny_model_path] * 2)
        with torch.no_grad():
            for agent in agents:
                for name, param in policies.named_trainable_parameters(agent).items():
                    if "lora_B" in name:
                        param.normal_(std=0.5)
        for agent in agents:
            policies.save_agent(agent, run / "adapters")
        config = {"model": tiny_model_path, "finetune": "lora", "use_chat_template": True}
        (run / "config.json").write_text(json.dumps(config))
        runs[tuple(agents)] = (run, policies)
    return runs


ENVS = {
    "tldr": dict(data=str(DATA / "tldr_sample.jsonl")),
    "arxiv": dict(data=str(DATA / "arxiv_sample.jsonl")),
    "humaneval": dict(),  # bundled data, the paper's eval split (problems 133-163)
    "coophumaneval": dict(data=str(DATA / "coding_sample.jsonl"), split="all"),
}


@pytest.mark.parametrize("env_name", list(ENVS))
def test_every_protocol_on_every_env(env_name, tmp_path, tiny_model_path, trained_run):  # noqa: F811
    env, env_id, _ = ev.make_env(ev.EvalSettings(env=env_name, protocols=[], **ENVS[env_name]))
    run, _ = trained_run[tuple(env.possible_agents)]
    settings = ev.EvalSettings(
        env=env_name,
        protocols=list(PROTOCOLS),
        adapters=str(run),
        model=tiny_model_path,
        samples=2,
        k=[1, 2],
        limit=2,
        max_new_tokens=6,
        progress=False,
        output_dir=str(tmp_path / "out"),
        **ENVS[env_name],
    )
    result = ev.evaluate(settings)
    files = ev.write_outputs(result)
    assert list(result.rows) == list(PROTOCOLS)
    table = ev.markdown_table(result).splitlines()
    columns = ev.table_columns(result.family, [1, 2], set())
    assert len(table) == 2 + len(PROTOCOLS)
    assert all(line.count("|") == len(columns) + 2 for line in table)
    assert result.family == ("coding" if "humaneval" in env_name else "writing")
    for row in result.rows.values():
        for key, _, _ in columns:
            assert key in row
        assert row["seconds_per_sample"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["env"] == env_id and saved["problems"] == 2
    assert all(f.is_file() for f in files)
    # every recorded joint action, re-scored by a fresh env, gives the recorded parts
    records = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    assert len(records) == len(PROTOCOLS) * 2 * 2
    for record in records[:: len(records) // 4]:
        env.reset(options={"index": record["problem"]})
        _, rewards, _, _, infos = env.step(record["actions"][0])
        agent = env.possible_agents[0]
        assert infos[agent]["reward_parts"] == pytest.approx(record["reward_parts"][0])
        assert rewards[agent] == pytest.approx(record["rewards"][0])
    # the table's numbers are the mean of those reward parts
    for protocol in PROTOCOLS:
        parts = [r["reward_parts"][0] for r in records if r["protocol"] == protocol]
        name = "tests" if result.family == "coding" else "structure"
        expected = sum(p[name] for p in parts) / len(parts)
        assert result.rows[protocol][f"part/{name}"] == pytest.approx(expected)


def test_trained_adapters_load_exactly(trained_run):
    run, original = trained_run[("aux", "main")]
    settings = ev.EvalSettings(env="coophumaneval", protocols=["trained"], adapters=str(run))
    loaded = ev.load_trained(settings, ["aux", "main"])
    for agent in ("aux", "main"):
        want = original.named_trainable_parameters(agent)
        got = loaded.named_trainable_parameters(agent)
        assert set(want) == set(got)
        assert all(torch.equal(want[n], got[n]) for n in want)
    greedy = SamplingParams(6, temperature=0.0)
    requests = [("aux", "say words"), ("main", "say words")]
    assert [[c.text for c in g] for g in loaded.sample(requests, 1, greedy)] == [
        [c.text for c in g] for g in original.sample(requests, 1, greedy)
    ]
    # the adapters folder itself is accepted too
    assert ev.find_trained(str(run / "adapters"), ["aux", "main"]).kind == "peft"


def test_trainer_run_evaluates_on_a_custom_env(tmp_path, tiny_model_path):  # noqa: F811
    from magrpo.config import MAGRPOConfig
    from magrpo.trainer import MAGRPOTrainer

    config = MAGRPOConfig(
        model=tiny_model_path, output_dir=str(tmp_path / "run"), max_steps=1, group_size=2,
        max_new_tokens=6, eval_interval=0, progress_bar=False, env_workers=2,
    )  # fmt: skip
    trainer = MAGRPOTrainer(config, WordGameEnv(), model_resolver=str)
    try:
        trainer.train()
    finally:
        trainer.close()
    settings = ev.EvalSettings(
        env="word-game", protocols=["parallel", "trained"], adapters=str(tmp_path / "run"),
        samples=2, k=[1], limit=3, max_new_tokens=6, progress=False,
        output_dir=str(tmp_path / "eval"),
    )  # fmt: skip
    result = ev.evaluate(settings, env=WordGameEnv())
    assert result.family == "generic" and set(result.rows) == {"parallel", "trained"}
    assert {"part/vowels", "part/longer", "return"} <= set(result.rows["trained"])
    assert "| trained |" in ev.markdown_table(result)


def test_real_coophumaneval_default_split(coophumaneval_file, tiny_model_path):  # noqa: F811
    settings = ev.EvalSettings(env="coophumaneval", protocols=[], data=str(coophumaneval_file))
    env, env_id, split = ev.make_env(settings)
    assert (env_id, split, env.num_items) == ("coophumaneval-v2", "eval", 16)
    humaneval, _, _ = ev.make_env(ev.EvalSettings(env="humaneval", protocols=[]))
    assert humaneval.num_items == 31  # problems 133-163


# --- charts and the command line ---------------------------------------------------------------


def test_plot_training_curves(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"step": s, "reward/mean": 0.1 * s, "reward/std": 0.05, "turn2/reward/mean": 0.2 * s,
         "turn2/reward/std": 0.1, "reward_parts/tests": 0.01 * s, "reward_parts/syntax": 0.5,
         "turn2/reward_parts/tests": 0.02 * s, "eval/reward/mean": 0.3 if s % 2 else None}
        for s in range(1, 6)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    written = plot_training(run)
    assert [p.name for p in written] == ["training_reward.png", "training_reward_parts.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert plot_main([str(run), "--output", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "training_reward.png").is_file()
    assert plot_main([str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--protocols", "parallel,telepathy"], "Unknown protocol"),
        (["--protocols", "trained"], "needs --adapters"),
        (["--protocols", "trained", "--adapters", "/no/such/run"], "no such folder"),
        (["--samples", "5", "--k", "1,10"], "k <= samples"),
        (["--k", "0"], "positive integers"),
        (["--models", "a,b,c"], "one model per agent"),
        (["--split", "nope"], "splits"),
    ],
)
def test_cli_user_errors_are_one_paragraph(argv, needle, capsys):
    data = ["--data", str(DATA / "coding_sample.jsonl"), "--split", "all"]
    code = ev.main(["--env", "coophumaneval", *data, "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_cli_is_built_like_the_trainers():
    """Flags come from EvalSettings as train's come from MAGRPOConfig: the same list syntax
    (space- or comma-separated) and help grouped by the settings' sections."""
    from magrpo.config import build_arg_parser

    space = ev.settings_from_args(["--env", "tldr", "--protocols", "parallel", "single",
                                   "--k", "1", "3", "--models", "a", "b"])  # fmt: skip
    comma = ev.settings_from_args(["--env", "tldr", "--protocols", "parallel,single",
                                   "--k", "1,3", "--models", "a,b"])  # fmt: skip
    assert space == comma
    assert (space.protocols, space.k, space.models) == (["parallel", "single"], [1, 3], ["a", "b"])
    assert ev.settings_from_args(["--env", "tldr"]).protocols == list(ev.DEFAULT_BASELINES)
    assert build_arg_parser().parse_args(["--models", "a", "b"]).models == ["a", "b"]
    assert "Sampling and metrics:" in ev.build_parser().format_help()
    assert "Speed and memory:" in build_arg_parser().format_help()
    with pytest.raises(SystemExit):
        ev.build_parser().parse_args([])  # --env is required


def test_cli_empty_adapters_folder(tmp_path, capsys):
    code = ev.main(["--env", "tldr", "--data", str(DATA / "tldr_sample.jsonl"),
                    "--protocols", "trained", "--adapters", str(tmp_path)])  # fmt: skip
    assert code == 2 and "holds no trained agents" in capsys.readouterr().err


def test_cli_end_to_end(tmp_path, tiny_model_path, capsys):  # noqa: F811
    out = tmp_path / "eval"
    code = ev.main([
        "--env", "tldr", "--data", str(DATA / "tldr_sample.jsonl"), "--model", tiny_model_path,
        "--protocols", "parallel,single", "--samples", "3", "--k", "1,3", "--limit", "2",
        "--max-new-tokens", "5", "--output-dir", str(out), "--no-progress",
    ])  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == 0
    assert "| protocol | structure (L1-3) |" in stdout and "| single |" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"results.json", "results.md", "samples.jsonl", "eval_metrics.png",
            "eval_speed.png"} <= names  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert math.isfinite(results["protocols"]["parallel"]["metrics"]["return"])
    assert plot_main([str(out), "--output", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "eval_metrics.png").is_file()
    assert Path(out / "results.md").read_text().count("\n| ") == 3
