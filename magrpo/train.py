"""Command line: ``python -m magrpo.train --env coophumaneval [--config FILE] [--flags]``.

Every field of :class:`~magrpo.config.MAGRPOConfig` is a kebab-case flag
(``--group-size 4 --max-new-tokens 128 --max-steps 50 --output-dir runs/x``); ``--config``
reads a YAML file first (e.g. ``configs/paper/coophumaneval.yaml``) and flags override it.
Environments come from ``llm_marl_envs.make``; errors a user can cause (unknown env,
unreadable dataset, bad value, missing model) are printed as one paragraph, exit code 2.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from magrpo.checkpoint import MODELS_DIR
from magrpo.config import ConfigError, MAGRPOConfig, config_from_args
from magrpo.env_contract import IncompatibleEnvError
from magrpo.errors import ModelLoadError
from magrpo.trainer import MAGRPOTrainer, TrainResult
from magrpo.vllm_sampler import VLLMUnavailableError

logger = logging.getLogger("magrpo")


def make_env(config: MAGRPOConfig, split: str | None) -> Any:
    """Build the env of ``config`` through ``llm_marl_envs.make`` (imported here, lazily)."""
    import llm_marl_envs

    kwargs = dict(config.env_kwargs)
    if config.data is not None:
        kwargs["data"] = config.data
    if split is not None:
        kwargs["split"] = split
    kwargs.setdefault("max_turns", config.num_turns)
    return llm_marl_envs.make(config.env, **kwargs)


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [
        ConfigError,
        ModelLoadError,
        IncompatibleEnvError,
        VLLMUnavailableError,
    ]
    try:
        from llm_marl_envs import LLMMarlEnvError

        errors.append(LLMMarlEnvError)
    except ImportError:
        pass
    try:
        from magrpo.models import ModelNotFoundError

        errors.append(ModelNotFoundError)
    except ImportError:
        pass
    return tuple(errors)


def train(config: MAGRPOConfig) -> TrainResult:
    """Build envs and policies from ``config``, train, print a summary."""
    import llm_marl_envs

    env_id = llm_marl_envs.resolve_env_id(config.env)
    train_env = make_env(config, config.train_split)
    eval_split = config.eval_split or llm_marl_envs.default_eval_split(env_id)
    eval_env = make_env(config, eval_split) if config.eval_interval else None
    started = time.perf_counter()
    trainer = MAGRPOTrainer(config, train_env, eval_env=eval_env)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    if trainer.parallel.is_main:
        print_summary(result, time.perf_counter() - started, config.algorithm)
    return result


def print_summary(result: TrainResult, seconds: float, algorithm: str = "magrpo") -> None:
    minutes, secs = divmod(int(seconds), 60)
    eval_text = (
        "" if result.last_eval_reward is None else f", last eval {result.last_eval_reward:.3f}"
    )
    loader = (
        "transformers: AutoModelForCausalLM.from_pretrained"
        if result.adapters_dir.name == MODELS_DIR
        else "peft: PeftModel.from_pretrained"
    )
    lines = [
        f"{algorithm.upper()} finished: {result.steps} steps in {minutes}m{secs:02d}s",
        f"  joint reward: last {result.last_reward:.3f}, best {result.best_reward:.3f}{eval_text}",
        f"  metrics:      {result.metrics_path}",
        f"  checkpoints:  {result.output_dir / 'checkpoints'} (continue with --resume)",
        f"  agents:       {result.adapters_dir}/<agent> ({loader})",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    # under torchrun / accelerate launch, the other processes only report problems
    main_process = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(
        level=logging.INFO if main_process else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(argv)
        train(config)
    except _user_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
