"""A decode step's products, streamed from memory: the blocked kernel against oneDNN (CPU).

    .venv/bin/python benchmarks/decode_products.py
    .venv/bin/python benchmarks/decode_products.py --rows 4 8 --threads 2 --repeats 9

One "step" multiplies ``rows`` input rows by every weight of a SmolLM2-135M-shaped model
once, as the fused decode step does (``magrpo/speedups/llama_decode.py``): per layer q/k/v fused
(576 -> 960), o (576 -> 576), gate/up fused (576 -> 3072) and down (1536 -> 576), for 30
layers, then the output layer (576 -> 49152): 538 MB of float32 weights, far more than the
caches hold, so every step streams them from memory, as decoding does. (A benchmark that
repeats one weight measures the caches instead: ``linear_kernels.py``.) Kernels:

- ``blocked``: ``magrpo.speedups.blocked_matmul.BlockedMatmul`` (weights blocked once);
- ``oneDNN``: ``torch.ops.mkldnn._linear_pointwise`` on weights packed once for ``rows``.

The two alternate within each repeat (one warm-up first), in one process. Prints a
Markdown table: median milliseconds per step, the weights' GB/s, and the ratio; then the
GB/s of a plain sum over the same bytes (what memory streams on this machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from magrpo.speedups.blocked_matmul import BlockedMatmul, library

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * LAYERS + [(49152, 576)]


def step_seconds(weights, blocked, rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one step by the blocked kernel and by oneDNN, alternating."""
    inputs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    times: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        for w, product in zip(weights, blocked, strict=True):
            product(inputs[w.shape[1]])
        middle = time.perf_counter()
        for w, pw in zip(weights, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], pw, None, "none", [], "")
        if repeat:
            times[0].append(middle - started)
            times[1].append(time.perf_counter() - middle)
    return statistics.median(times[0]), statistics.median(times[1])


def sum_seconds(weights, repeats: int) -> float:
    flat = torch.cat([w.reshape(-1) for w in weights])
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        flat.sum()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if library() is None:
        raise SystemExit("The blocked kernel cannot be built here (see the warning above).")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    gigabytes = sum(w.numel() for w in weights) * 4 / 1e9
    blocked = [BlockedMatmul([w]) for w in weights]
    print("| threads | rows | blocked ms | GB/s | oneDNN ms | GB/s | oneDNN / blocked |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            ours, theirs = step_seconds(weights, blocked, rows, args.repeats)
            print(
                f"| {threads} | {rows} | {1e3 * ours:.1f} | {gigabytes / ours:.1f} "
                f"| {1e3 * theirs:.1f} | {gigabytes / theirs:.1f} | {theirs / ours:.2f}x |",
                flush=True,
            )
        summed = gigabytes / sum_seconds(weights, args.repeats)
        print(f"| {threads} | a sum | | {summed:.1f} | | | |", flush=True)


if __name__ == "__main__":
    main()
