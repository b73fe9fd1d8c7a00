"""The PettingZoo contract, determinism, branching and multi-turn behaviour of every env."""

import copy

import pytest
from conftest import DATA
from pettingzoo.test import api_test, parallel_api_test
from pettingzoo.utils.conversions import parallel_to_aec

import llm_marl_envs

ENV_KWARGS = {
    "tldr-v2": {"data": DATA / "tldr_sample.jsonl"},
    "arxiv-v2": {"data": DATA / "arxiv_sample.jsonl"},
    "humaneval-v2": {"split": "eval"},
    "coophumaneval-v2": {"data": DATA / "coding_sample.jsonl", "split": "all"},
}

SAMPLE_ACTIONS = {
    "tldr-v2": {
        "concise": "The poster's roommate keeps eating her food and denies it every time.",
        "detailed": (
            "The poster shares an apartment with a coworker. However, for two months her "
            "groceries have vanished; for example, yogurt and rice. Therefore she labelled "
            "everything, yet the roommate denies it, and she now wonders how to raise it calmly "
            "without hurting their relationship at work."
        ),
    },
    "arxiv-v2": {
        "background": "Teams of models coordinate. " * 30,
        "method": "We train jointly. " * 45,
    },
    "humaneval-v2": {"aux": "def aux(x):\n    return x", "main": "def f():\n    return 1"},
    "coophumaneval-v2": {
        "aux": "def aux(ch):\n    return ch.lower() in 'aeiou'",
        "main": "def count_vowels(text):\n    return sum(1 for ch in text if aux(ch))",
    },
}


def test_registry_lists_the_four_tasks():
    assert set(llm_marl_envs.registry()) == set(ENV_KWARGS)
    assert all(llm_marl_envs.registry().values())
    # the paper evaluates the coding tasks on its "eval" problems, the writing tasks on "test"
    assert llm_marl_envs.default_eval_split("coophumaneval") == "eval"
    assert llm_marl_envs.default_eval_split("humaneval-v2") == "eval"
    assert (
        llm_marl_envs.default_eval_split("arxiv")
        == llm_marl_envs.default_eval_split("tldr")
        == "test"
    )


def test_unknown_env_id_names_the_known_ones():
    with pytest.raises(llm_marl_envs.UnknownEnvError) as caught:
        llm_marl_envs.make("coophumanevl")
    message = str(caught.value)
    assert "coophumaneval-v2" in message and "Did you mean" in message


def test_alias_without_version_and_pettingzoo_registry():
    import pettingzoo

    assert llm_marl_envs.resolve_env_id("tldr") == "tldr-v2"
    env = pettingzoo.make("parallel", "tldr-v2", data=DATA / "tldr_sample.jsonl")
    assert env.possible_agents == ["concise", "detailed"]


SUCCESSORS = {
    "tldr-v0": "tldr-v2",
    "arxiv-v0": "arxiv-v2",
    "tldr-v1": "tldr-v2",
    "arxiv-v1": "arxiv-v2",
    "humaneval-v0": "humaneval-v2",
    "coophumaneval-v0": "coophumaneval-v2",
    "humaneval-v1": "humaneval-v2",
    "coophumaneval-v1": "coophumaneval-v2",
}


@pytest.mark.parametrize("old", sorted(SUCCESSORS))
def test_retired_ids_name_their_successor_and_what_changed(old):
    new = SUCCESSORS[old]
    with pytest.raises(llm_marl_envs.DeprecatedEnvError) as caught:
        llm_marl_envs.make(old)
    message = str(caught.value)
    assert f"use {new!r}" in message and "What changed:" in message
    assert isinstance(caught.value, llm_marl_envs.UnknownEnvError)  # old handlers still catch it
    assert llm_marl_envs.resolve_env_id(old.rsplit("-v", 1)[0]) == new


@pytest.mark.parametrize("old", ["humaneval-v1", "coophumaneval-v1"])
def test_coding_v1_ids_name_v2_and_the_main_prompt_change(old):
    with pytest.raises(llm_marl_envs.DeprecatedEnvError) as caught:
        llm_marl_envs.make(old, data=DATA / "coding_sample.jsonl", split="all")
    message = str(caught.value)
    assert f"use {old.replace('-v1', '-v2')!r}" in message
    assert "main is told to call aux" in message and "result = aux(" in message
    assert old not in llm_marl_envs.registry()


@pytest.mark.parametrize("env_id", sorted(ENV_KWARGS))
def test_envs_publish_their_id_and_answer_format(env_id):
    env = llm_marl_envs.make(env_id, **ENV_KWARGS[env_id])
    assert env.metadata["name"] == env_id
    assert set(env.metadata["answer_format"]) == set(env.possible_agents)
    for answer_format in env.metadata["answer_format"].values():
        assert answer_format["max_tokens"] > 0
        assert all(isinstance(stop, str) and stop for stop in answer_format["stop"])
    assert type(env).metadata["name"] == "text_parallel_v0"  # the class's stays untouched


@pytest.mark.parametrize("env_id", ["tldr-v2", "arxiv-v2"])
def test_writing_budget_stays_within_the_rewards_word_cap(env_id):
    """At one token or more per word, an answer cut at the budget still earns the structure
    level: the default token limit cannot zero the reward by itself."""
    env = llm_marl_envs.make(env_id, **ENV_KWARGS[env_id])
    most_words = env.task.reward_spec.word_range[1]
    assert all(f["max_tokens"] <= most_words for f in env.metadata["answer_format"].values())


@pytest.mark.parametrize("env_id", sorted(ENV_KWARGS))
def test_parallel_api(env_id):
    parallel_api_test(llm_marl_envs.make(env_id, **ENV_KWARGS[env_id], max_turns=2), num_cycles=4)


@pytest.mark.parametrize("env_id", sorted(ENV_KWARGS))
def test_aec_api(env_id):
    api_test(
        parallel_to_aec(llm_marl_envs.make(env_id, **ENV_KWARGS[env_id], max_turns=2)), num_cycles=4
    )


@pytest.mark.parametrize("env_id", sorted(ENV_KWARGS))
def test_full_episodes_are_deterministic(env_id):
    def episode(seed):
        env = llm_marl_envs.make(env_id, **ENV_KWARGS[env_id], max_turns=3)
        trace = [env.reset(seed=seed)]
        while env.agents:
            trace.append(env.step(SAMPLE_ACTIONS[env_id]))
        return trace

    first, again = episode(7), episode(7)
    assert first == again
    rewards = first[1][1]
    assert len(set(rewards.values())) == 1, "every agent gets the same joint reward"
    for info in first[1][4].values():
        assert sum(info["reward_parts"].values()) == pytest.approx(next(iter(rewards.values())))


def test_same_seed_same_item_and_index_option():
    env = llm_marl_envs.make("tldr-v2", data=DATA / "tldr_sample.jsonl")
    first, _ = env.reset(seed=3)
    assert env.reset(seed=3)[0] == first
    env.reset(options={"index": 5})
    assert env.item_index == 5
    with pytest.raises(llm_marl_envs.ConfigError):
        env.reset(options={"index": 99})


def test_deepcopy_branches_share_data_but_not_state():
    env = llm_marl_envs.make("coophumaneval-v2", **ENV_KWARGS["coophumaneval-v2"], max_turns=2)
    env.reset(options={"index": 0})
    branch = copy.deepcopy(env)
    assert branch.task is env.task and branch.task.records is env.task.records
    branch.step({"aux": "def aux(x):\n    return x", "main": "oops"})
    assert env.turn == 0 and branch.turn == 1


def test_multi_turn_coding_feedback_and_early_termination():
    env = llm_marl_envs.make("coophumaneval-v2", **ENV_KWARGS["coophumaneval-v2"], max_turns=3)
    env.reset(options={"index": 0})
    wrong = {
        "aux": "def aux(ch):\n    return ch in 'aeiou'",
        "main": "def count_vowels(text):\n    return len(text)",
    }
    observations, rewards, terminations, truncations, infos = env.step(wrong)
    assert not any(terminations.values()) and not any(truncations.values())
    assert "return len(text)" in observations["main"]
    assert "return len(text)" not in observations["aux"], "an agent sees only its own answer"
    assert "Tests passed: 1/4" in observations["main"] and "Failed: assert" in observations["aux"]
    assert infos["main"]["tests_passed"] == 1 and infos["main"]["tests_total"] == 4

    observations, rewards, terminations, *_ = env.step(SAMPLE_ACTIONS["coophumaneval-v2"])
    assert all(terminations.values()) and env.agents == []
    assert rewards["main"] == pytest.approx(4.0)


def test_multi_turn_writing_feedback_names_the_failed_level():
    env = llm_marl_envs.make("tldr-v2", data=DATA / "tldr_sample.jsonl", max_turns=2)
    env.reset(options={"index": 0})
    observations, rewards, *_, infos = env.step(
        {"concise": "Too short.", "detailed": "Also short."}
    )
    assert rewards["concise"] == 0.0 and infos["concise"]["failed_level"] == "structure"
    assert "'structure' level failed" in observations["detailed"]
    assert "Also short." in observations["detailed"]
    _, _, _, truncations, _ = env.step(SAMPLE_ACTIONS["tldr-v2"])
    assert all(truncations.values())


def test_bad_options_give_clear_errors(tmp_path):
    with pytest.raises(llm_marl_envs.ConfigError, match="max_turns"):
        llm_marl_envs.make("humaneval-v2", max_turns=0)
    with pytest.raises(llm_marl_envs.ConfigError, match="does not take"):
        llm_marl_envs.make("humaneval-v2", min_words=3)
    with pytest.raises(llm_marl_envs.ConfigError, match="split"):
        llm_marl_envs.make("humaneval-v2", split="validation")
    with pytest.raises(llm_marl_envs.ConfigError, match="split='all'"):
        llm_marl_envs.make("coophumaneval-v2", data=DATA / "coding_sample.jsonl", split="train")
    with pytest.raises(llm_marl_envs.DataUnavailableError, match="does not exist"):
        llm_marl_envs.make("tldr-v2", data=tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"title": "no prompt field"}\n')
    with pytest.raises(llm_marl_envs.DataFormatError, match="prompt"):
        llm_marl_envs.make("tldr-v2", data=broken)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(llm_marl_envs.DataFormatError, match="Could not parse"):
        llm_marl_envs.make("tldr-v2", data=garbage)


def test_unreachable_hub_names_dataset_and_data_option(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(llm_marl_envs.DataUnavailableError) as caught:
        llm_marl_envs.make("arxiv-v2", data="OpenMLRL/no-such-dataset-for-tests")
    assert "OpenMLRL/no-such-dataset-for-tests" in str(caught.value)
    assert "data=" in str(caught.value)


def test_save_to_disk_folder_and_parquet(tmp_path):
    import datasets

    table = datasets.load_dataset("json", data_files=str(DATA / "tldr_sample.jsonl"), split="train")
    table.save_to_disk(str(tmp_path / "folder"))
    table.to_parquet(str(tmp_path / "tldr.parquet"))
    for source in (tmp_path / "folder", tmp_path / "tldr.parquet"):
        env = llm_marl_envs.make("tldr-v2", data=source)
        assert env.num_items == len(table)


def test_folder_of_split_files_selects_the_split(tmp_path):
    lines = (DATA / "tldr_sample.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "train.jsonl").write_text("".join(lines[:8]))
    (tmp_path / "test.jsonl").write_text("".join(lines[8:]))
    assert llm_marl_envs.make("tldr-v2", data=tmp_path, split="train").num_items == 8
    assert llm_marl_envs.make("tldr-v2", data=tmp_path, split="test").num_items == len(lines) - 8
    with pytest.raises(llm_marl_envs.DataUnavailableError, match="has the splits"):
        llm_marl_envs.make("tldr-v2", data=tmp_path, split="validation")


def test_importing_the_envs_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, llm_marl_envs\n"
        "assert 'torch' not in sys.modules and 'magrpo' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("env_id", sorted(ENV_KWARGS))
def test_state_for_centralised_training(env_id):
    """state() passes PettingZoo's state test and holds every agent's observation, then the
    joint action and its result; the agents' observations never gain any of it."""
    from pettingzoo.test import state_test

    def make():
        return llm_marl_envs.make(env_id, **ENV_KWARGS[env_id], max_turns=2)

    with pytest.warns(UserWarning, match="not NumPy"):  # a text state, as observations are
        state_test(parallel_to_aec(make()), make(), num_cycles=4)
    env = make()
    observations, _ = env.reset(seed=3)
    state = env.state()
    assert env.state_space.contains(state)
    assert all(text in state for text in observations.values())
    actions = SAMPLE_ACTIONS[env_id]
    next_observations, rewards, *_ = env.step(actions)
    state = env.state()
    assert all(text in state for text in [*observations.values(), *actions.values()])
    assert f"joint reward {rewards[env.possible_agents[0]]:.3f}" in state
    assert all(text in state for text in next_observations.values())
    for agent, text in next_observations.items():  # decentralised: no other agent's answer
        assert not any(answer in text for other, answer in actions.items() if other != agent)
