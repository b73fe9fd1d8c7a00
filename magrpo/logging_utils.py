"""Metric sinks: ``metrics.jsonl`` always; TensorBoard when installed; W&B only when asked."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Append one JSON object per step to ``<output_dir>/metrics.jsonl`` (and mirrors)."""

    def __init__(
        self,
        output_dir: str | Path,
        backends: list[str],
        config: dict[str, Any] | None = None,
        wandb_project: str = "magrpo",
        resume_step: int | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        kept: list[str] = []
        if resume_step is not None and self.path.exists():
            # drop records written after the checkpoint we resume from (they will be redone)
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
        self._file = open(self.path, "w")  # noqa: SIM115 - closed in close()
        self._file.writelines(line + "\n" for line in kept)
        self._tensorboard = None
        self._wandb = None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))
            except ImportError:
                logger.info("tensorboard is not installed: metrics go to metrics.jsonl only")
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError(
                    "--log-backends wandb was asked for but the wandb package is not installed: "
                    "pip install wandb, or drop wandb from --log-backends."
                ) from error
            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.output_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullMetricsLogger:
    """The metrics sink of the data-parallel processes other than the first: writes nothing."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / "metrics.jsonl"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, total: int, initial: int):
    """A tqdm bar of the training steps (None when disabled)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="magrpo", unit="step", dynamic_ncols=True)
