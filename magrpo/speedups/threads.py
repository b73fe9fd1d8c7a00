"""Independent CPU jobs side by side, each on its share of torch's threads.

A decode step of a small model on CPU is bound by memory bandwidth in its products and by
per-operator overhead everywhere else, so two threads on one model leave both partly idle.
Two models (full fine-tuning: one per agent) decoding at the same time, one thread each,
overlap one model's small operators with the other's products: on 2 threads, sampling
two SmolLM2 models side by side measured 1.19x faster than one after the other, and a full
fine-tuning step's generation 13% faster (``benchmarks/decode_step.py --finetune full
--against one-at-a-time``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def run_side_by_side(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """``[job() for job in jobs]``, run by up to ``torch.get_num_threads()`` worker threads
    that split those threads between them (the first ones get the remainder). With one
    thread or one job it is exactly that list comprehension, in the calling thread.

    torch's thread count is per thread (OpenMP), so the caller's own is left as it was.
    The jobs must not share mutable state, nor draw from torch's global generator (the
    order of their draws would depend on the scheduling).
    """
    total = torch.get_num_threads()
    workers = min(len(jobs), total)
    if workers < 2:
        return [job() for job in jobs]
    shares = [total // workers + (k % workers < total % workers) for k in range(len(jobs))]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_run_on_threads, jobs, shares))


def _run_on_threads(job: Callable[[], T], threads: int) -> T:
    torch.set_num_threads(threads)
    return job()
