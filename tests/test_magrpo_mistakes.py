"""Mistakes a user can make that used to pass silently: each now errors or says what happens."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
from conftest import DATA
from magrpo_fixtures import WordGameEnv, build_tiny_model, build_tokenizer

import llm_marl_envs
from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.env_contract import IncompatibleEnvError, check_horizon
from magrpo.errors import ModelLoadError
from magrpo.loading import load_policies
from magrpo.trainer import MAGRPOTrainer


def test_a_group_of_one_is_refused_where_the_baseline_needs_a_group():
    for advantage in ("magrpo", "rloo", "remax"):
        with pytest.raises(ConfigError, match="group_size"):
            MAGRPOConfig(group_size=1, advantage=advantage)
    with pytest.warns(UserWarning, match="no group baseline"):
        MAGRPOConfig(group_size=1, advantage="reinforce")


def test_the_token_limit_is_the_envs_budget_unless_given(tmp_path):
    """The default limit comes from the env (``answer_format``): 256 for the writing tasks,
    whose rewards cap answers at 256 words, 384 for the coding tasks. An env that declares
    no budget needs one given, rather than a number chosen for another task."""
    path = build_tiny_model(tmp_path / "tiny")
    config = MAGRPOConfig(model=str(path), max_steps=1, output_dir=str(tmp_path / "run"))
    assert config.max_new_tokens is None
    envs = {
        256: llm_marl_envs.make("tldr", data=DATA / "tldr_sample.jsonl"),
        384: llm_marl_envs.make("coophumaneval", data=DATA / "coding_sample.jsonl", split="all"),
    }
    for budget, env in envs.items():
        assert MAGRPOTrainer(config, env, model_resolver=str).config.max_new_tokens == budget
    given = MAGRPOConfig(model=str(path), max_steps=1, max_new_tokens=7)
    assert MAGRPOTrainer(given, envs[384], model_resolver=str).config.max_new_tokens == 7
    with pytest.raises(IncompatibleEnvError, match="--max-new-tokens"):
        MAGRPOTrainer(config, WordGameEnv(), model_resolver=str)
    assert MAGRPOTrainer(given, WordGameEnv(), model_resolver=str).config.max_new_tokens == 7
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        MAGRPOConfig(max_new_tokens=0)


def test_resolving_the_token_limit_does_not_repeat_config_warnings(tmp_path):
    path = build_tiny_model(tmp_path / "tiny")
    with pytest.warns(UserWarning, match="no group baseline"):
        config = MAGRPOConfig(model=str(path), group_size=1, advantage="reinforce")
    env = llm_marl_envs.make("tldr", data=DATA / "tldr_sample.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = MAGRPOTrainer(config, env, model_resolver=str)
    assert trainer.config.max_new_tokens == 256
    assert not [w for w in caught if "no group baseline" in str(w.message)]


def test_horizon_longer_than_the_env_is_refused_shorter_is_said(caplog):
    with pytest.raises(IncompatibleEnvError, match="--num-turns 2"):
        check_horizon(WordGameEnv(max_turns=2), num_turns=3)
    with caplog.at_level(logging.WARNING, logger="magrpo.trainer"):
        check_horizon(WordGameEnv(max_turns=2), num_turns=1)
    assert "never trained" in caplog.text
    check_horizon(WordGameEnv(max_turns=2), num_turns=2)  # agreeing: silent


def test_adapters_are_selected_by_exact_name(tmp_path):
    """An agent named ``model`` must not take ``base_model.model.*`` of every adapter."""
    path = build_tiny_model(tmp_path / "tiny")
    policies = load_policies(["model", "lora"], [str(path)] * 2)
    mine = policies.named_trainable_parameters("model")
    other = policies.named_trainable_parameters("lora")
    assert mine and other and not set(mine) & set(other)
    assert all(".model.weight" in name for name in mine)
    assert len(mine) == len(other)


def test_a_missing_chat_template_is_an_error(tmp_path):
    path = build_tiny_model(tmp_path / "tiny")
    for template in path.glob("chat_template*"):
        template.unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="--no-use-chat-template"):
        load_policies(["alice", "bob"], [str(path)] * 2)
    load_policies(["alice", "bob"], [str(path)] * 2, use_chat_template=False)


def test_a_turn_end_that_is_not_eos_becomes_a_stop_token(tmp_path, caplog):
    path = build_tiny_model(tmp_path / "tiny")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<unk>")
    tokenizer.save_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="magrpo.policies"):
        policies = load_policies(["alice", "bob"], [str(path)] * 2)
    assert "'<unk>'" in caplog.text
    assert tokenizer.convert_tokens_to_ids("<unk>") in policies.models[0].eos_ids
