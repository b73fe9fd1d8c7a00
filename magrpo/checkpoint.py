"""Atomic checkpoints: trainable weights, optimizers, RNG states, step and data order.

A checkpoint is written to ``<output_dir>/checkpoints/.tmp-step-N`` and then renamed to
``step-N`` with ``os.replace`` (atomic on one filesystem), so a run killed at any moment
leaves either the previous checkpoints or a complete new one, never a half-written one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"
# the final agents of a run: full models, or peft adapters (``MAGRPOTrainer.save_final``)
MODELS_DIR, ADAPTERS_DIR = "models", "adapters"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    output_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write ``state`` (any torch-serialisable dict) atomically; keep the newest ``keep``."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    with open(tmp / STATE_FILE, "rb") as handle:
        os.fsync(handle.fileno())
    if final.exists():  # re-saving the same step (e.g. the final one): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
