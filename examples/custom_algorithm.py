"""Add an algorithm to MAGRPO without touching the trainer.

This registers a new advantage estimator by name, a leave-one-out baseline whose
advantages are clipped to [-1, 1], and trains with it plus a KL penalty to the reference
policy (with LoRA the reference is the base model with adapters disabled: no extra memory)::

    python examples/custom_algorithm.py                      # SmolLM2, TLDR sample data
    python examples/custom_algorithm.py --model path/to/tiny --max-steps 2

Any ``MAGRPOConfig`` flag works here too. The same pattern registers a loss reduction
(``magrpo.register_loss``); for deeper changes subclass ``MAGRPOTrainer`` and override one of
``collect``, ``build_samples`` or ``update``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from magrpo import register_advantage
from magrpo.config import config_from_args
from magrpo.train import train

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "tldr_sample.jsonl"


@register_advantage("loo_clipped")
def leave_one_out_clipped(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - mean of the other samples' returns, clipped to [-1, 1]."""
    others = (returns.sum() - returns) / max(returns.numel() - 1, 1)
    return (returns - others).clamp(-1.0, 1.0)


def main(argv: list[str] | None = None):
    defaults = [
        "--env", "tldr",
        "--data", str(SAMPLE_DATA),
        "--advantage", "loo_clipped",
        "--kl-coef", "0.05",
        "--max-steps", "2",
        "--max-new-tokens", "32",
        "--eval-interval", "0",
        "--output-dir", "runs/custom_algorithm",
    ]  # fmt: skip
    config = config_from_args(defaults + list(sys.argv[1:] if argv is None else argv))
    return train(config)


if __name__ == "__main__":
    main()
