"""MAGRPOConfig: documented fields, YAML + CLI overrides, clear validation errors."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from magrpo.cli import add_dataclass_arguments, flag_help
from magrpo.config import ConfigError, MAGRPOConfig, build_arg_parser, config_from_args

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_every_field_documented_and_a_flag():
    parser_flags = {a.dest for a in build_arg_parser()._actions}
    for f in dataclasses.fields(MAGRPOConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert f.name in parser_flags


def test_cli_flags_override_yaml(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("group_size: 8\nmax-new-tokens: 32\nenv: tldr\nlearning_rate: 1.0e-5\n")
    config = config_from_args(
        [
            "--config", str(config_file),
            "--group-size", "4",
            "--max-steps", "50",
            "--output-dir", "runs/x",
            "--env-kwargs", '{"max_turns": 2}',
            "--lora-target-modules", "q_proj", "k_proj",
            "--no-use-chat-template",
            "--early-termination-threshold", "none",
            "--models", "m1,m2",
        ]
    )  # fmt: skip
    assert config.group_size == 4 and config.max_new_tokens == 32 and config.env == "tldr"
    assert config.max_steps == 50 and config.output_dir == "runs/x"
    assert config.env_kwargs == {"max_turns": 2} and config.learning_rate == 1e-5
    assert config.lora_target_modules == ["q_proj", "k_proj"]
    assert config.use_chat_template is False and config.early_termination_threshold is None
    assert config.models == ["m1", "m2"]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"group_size": 0}, "group_size=0"),
        ({"joint_mode": "diagonal"}, "aligned, cross"),
        ({"advantage": "nope"}, "magrpo"),
        ({"loss_type": "nope"}, "sequence_sum"),
        ({"discount": 1.5}, "[0, 1]"),
        ({"num_update_epochs": 2}, "--clip-epsilon"),
        ({"max_steps": None}, "num_epochs"),
        ({"log_backends": ["mlflow"]}, "log_backends"),
        ({"dtype": "int8"}, "bfloat16"),
        ({"generation_backend": "sglang"}, "hf, vllm"),
        ({"vllm_gpu_memory_utilization": 1.5}, "(0, 1)"),
        ({"agent_devices": []}, "one device per agent"),
        ({"eval_size": 0}, "eval_interval > 0"),
        ({"cpu_heap": "hoard"}, "auto, keep, release"),
    ],
)
def test_validation_errors_are_clear(changes, needle):
    with pytest.raises(ConfigError, match="Invalid configuration") as raised:
        MAGRPOConfig(**changes)
    assert needle in str(raised.value)


def test_unknown_key_lists_known_ones():
    with pytest.raises(ConfigError, match="group_size"):
        MAGRPOConfig.from_dict({"group_sise": 4})


@pytest.mark.parametrize("name", ["cpu", "paper/tldr", "paper/arxiv", "paper/humaneval",
                                  "paper/coophumaneval"])  # fmt: skip
def test_shipped_configs_load(name):
    config = MAGRPOConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert config.group_size >= 2


@dataclasses.dataclass
class _PercentSettings:
    share: float = dataclasses.field(default=0.9, metadata=flag_help("91% of answers, %(x)s"))


def test_help_texts_keep_a_percent_sign_as_written():
    """argparse expands %-formats in help; '91% of' would raise or print garbage unescaped."""
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _PercentSettings)
    assert "91% of answers, %(x)s" in " ".join(parser.format_help().split())
