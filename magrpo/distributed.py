"""Data parallelism for MAGRPO over the processes that ``accelerate launch`` / ``torchrun`` start.

Every process holds the whole model(s) and walks the same data order; a step's episode roots
are dealt round-robin, so each process samples, rewards and back-propagates its own share.
Groups never span processes (a group is one node of one root's tree), so advantages need no
communication. What does:

- loss normalisers use the *global* per-agent sequence and token counts, so the per-process
  gradients *sum* to the single-process gradient of the global batch (one all-reduce per agent
  and update epoch, after the micro-batches have accumulated: like DDP's ``no_sync``);
- metrics are computed from every process's records (gathered), not averaged per process;
- the initial trainable weights are broadcast from process 0, checkpoints are written by
  process 0 only and read by every process on resume.

With one process every operation is the identity, so the trainer has a single code path.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from accelerate.utils import broadcast, gather_object, reduce
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from magrpo.rollout import RolloutResult

T = TypeVar("T")


class DataParallel:
    """This process's place among the data-parallel processes of an ``Accelerator``."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.world_size = int(accelerator.num_processes)
        self.rank = int(accelerator.process_index)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's share of a global list (round-robin, so shares differ by <= 1)."""
        return list(items[self.rank :: self.world_size])

    def gather(self, records: list[T]) -> list[T]:
        """Every process's records concatenated (rank order); the same list on every rank."""
        if self.world_size == 1:
            return records
        return gather_object(records)

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over processes."""
        if self.world_size == 1:
            return [float(v) for v in values]
        total = reduce(torch.tensor(values, dtype=torch.float64, device=self._device), "sum")
        return total.tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> bool:
        """Sum the gradients of ``parameters`` over processes, in one flat all-reduce.

        A process whose micro-batches did not touch the parameters contributes zeros.
        Returns whether any process had a gradient (no gradient anywhere: skip the step).
        """
        params = list(parameters)
        has_grad = any(p.grad is not None for p in params)
        if self.world_size == 1:
            return has_grad
        if not self.any(has_grad):
            return False
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        summed = reduce(_flatten_dense_tensors(grads), "sum")
        for param, grad in zip(params, _unflatten_dense_tensors(summed, grads), strict=True):
            param.grad = grad
        return True

    def broadcast_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Give every process process 0's values (identical starts, whatever the init RNG)."""
        if self.world_size == 1:
            return
        params = list(parameters)
        if not params:
            return
        flat = broadcast(_flatten_dense_tensors([p.detach() for p in params]), from_process=0)
        with torch.no_grad():
            for param, value in zip(params, _unflatten_dense_tensors(flat, params), strict=True):
                param.copy_(value)

    def barrier(self) -> None:
        if self.world_size > 1:
            self.accelerator.wait_for_everyone()

    @property
    def _device(self) -> torch.device:
        return self.accelerator.device

    def gather_rollouts(self, rollout: RolloutResult) -> RolloutResult:
        """Every process's rollout as one record for metrics (texts and token ids left out).

        Seconds are the slowest process's: it sets the step time.
        """
        if self.world_size == 1:
            return rollout
        slim = RolloutResult(
            [
                dataclasses.replace(n, samples={}, observations={}, state=None)
                for n in rollout.nodes
            ],
            rollout.num_roots,
            rollout.seconds_generate,
            rollout.seconds_env,
            rollout.generated_tokens,
        )
        shares = self.gather([slim])
        return RolloutResult(
            [node for share in shares for node in share.nodes],
            sum(share.num_roots for share in shares),
            max(share.seconds_generate for share in shares),
            max(share.seconds_env for share in shares),
            sum(share.generated_tokens for share in shares),
        )


def local_launcher(processes: int) -> list[str]:
    """The command prefix that runs a Python module in ``processes`` local processes
    (``torchrun`` on a free port; a plain interpreter for one process). Append ``-m module``."""
    if processes == 1:
        return [sys.executable]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={processes}",
        f"--master-port={port}",
    ]
