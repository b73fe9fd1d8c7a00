"""Speed and memory: everything that exists only to make training faster or leaner.

The core (``policies.py``, ``trainer.py``, ``losses.py``) runs plain transformers + peft +
torch and reaches this package through one object, called at a few named points:

- ``check_config``: once, before anything is loaded;
- ``prepare_model``: after a model is loaded, before its adapters are added;
- ``prepare_run``: once the trainer has its policies and optimizers;
- ``decoding``: when a model starts sampling (a faster decode forward, or None);
- ``run_samplers``: to run the models' decode loops (one after another, or at once);
- ``sampled``: with the completions that one decode loop produced;
- ``logprobs``: for a log-prob pass (a faster equivalent, or None);
- ``rollout_started``: before each rollout;
- ``before_pass``: before each log-prob pass and each backward;
- ``backward``: around each backward (a context manager);
- ``weights_changed``: after the optimizers stepped.

:class:`Speedups` is the do-nothing default (``--speedups off``): every point leaves the
plain path as it is. ``--speedups auto`` (the default) is
:class:`~magrpo.speedups.auto.AutoSpeedups`, which uses each technique where it applies;
``tests/test_speedups.py`` checks that both give the same completions and the same losses.
The techniques, one module each, and what each buys are listed in ``README.md`` here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

SPEEDUP_MODES = ("auto", "off")


class Speedups:
    """The plain path: every named point does nothing (``--speedups off``)."""

    mode = "off"

    def check_config(self, config: Any, world_size: int = 1, scales_loss: bool = False) -> None:
        """Raise ConfigError for settings these speed-ups cannot honour in a run of
        ``world_size`` processes (``scales_loss``: float16 mixed precision scales the loss)."""

    def prepare_model(self, model: Any) -> None:
        """A freshly loaded transformers model (before peft wraps it)."""

    def prepare_run(self, policies: Any, optimizers: dict[str, Any]) -> None:
        """The trainer's policies and per-agent optimizers, once, before training."""

    def decoding(self, policies: Any, loaded: Any, batch: Any) -> Any | None:
        """A context manager that yields a faster :class:`~magrpo.policies.Decoding` for
        ``batch`` (a :class:`~magrpo.policies.DecodeBatch`), or None for the plain one."""
        return None

    def run_samplers(
        self, jobs: Sequence[Callable[[], AbstractContextManager[Callable[[], Any]]]], seeded: bool
    ) -> list[Any]:
        """Run one sampling job per model: ``job()`` prepares the model's decoding and yields
        its decode loop. The plain path runs them one after another. ``seeded``: the rows
        draw from generators of their own (so the jobs may run at the same time)."""
        outputs = []
        for job in jobs:
            with job() as decode_loop:
                outputs.append(decode_loop())
        return outputs

    def sampled(self, loaded: Any, completions: Sequence[Any], prompts: Sequence[Any]) -> None:
        """The completions a decode loop of ``loaded`` produced, row by row."""

    def logprobs(
        self, policies: Any, batch: Any, reference: bool, temperature: float
    ) -> Any | None:
        """A faster equivalent of the plain log-prob pass over ``batch`` (a
        :class:`~magrpo.policies.LogprobInputs`), or None to run the plain one."""
        return None

    def rollout_started(self) -> None:
        """A rollout (sampling with the current weights) begins."""

    def before_pass(self) -> None:
        """A log-prob pass or a backward is about to run."""

    def backward(self, agents: Sequence[str], last: bool) -> AbstractContextManager:
        """The context of a backward of ``agents``' loss (``last``: their final micro-batch)."""
        return contextlib.nullcontext()

    def weights_changed(self) -> None:
        """The optimizers stepped: anything computed from the old weights is stale."""


def load_speedups(mode: str = "auto", **options: Any) -> Speedups:
    """The speed-ups of ``mode`` (``auto`` | ``off``), with the options of ``AutoSpeedups``."""
    if mode == "off":
        return Speedups()
    if mode == "auto":
        from magrpo.speedups.auto import AutoSpeedups

        return AutoSpeedups(**options)
    raise ValueError(f"speedups must be one of {SPEEDUP_MODES}, got {mode!r}")


def speedups_for(config: Any) -> Speedups:
    """The speed-ups a ``MAGRPOConfig`` asks for (``speedups`` and the memory options)."""
    if config.speedups == "off":
        return Speedups()
    from magrpo.speedups.auto import AutoSpeedups

    return AutoSpeedups.from_config(config)
