"""torch's ``F.linear`` against oneDNN's inner product at the shapes of a training step (CPU).

    .venv/bin/python benchmarks/linear_kernels.py              # float32 and bfloat16
    .venv/bin/python benchmarks/linear_kernels.py --dtypes float32 --repeats 50

The shapes are SmolLM2-135M's (hidden 576, MLP 1536, key/value 192): a decode step's 8 rows
(2 agents x G = 4) and an update's 256 rows (one agent's 4 completions of 64 tokens).
Kernels, each timed as the median of ``--repeats`` calls after warm-up, in one process:

- ``torch``: ``F.linear`` (float32 goes to the BLAS library, MKL in the x86 wheels;
  bfloat16 to oneDNN);
- ``oneDNN``: ``torch.ops.mkldnn._linear_pointwise`` on the weight as it is (what
  ``magrpo.speedups.onednn.onednn_linears(model)`` runs in the log-prob pass);
- ``oneDNN packed``: the same on a weight reordered once into oneDNN's blocked layout (what
  the decode loop runs);
- the backward's input gradient (``grad @ W``) with ``torch`` and ``oneDNN``.

Prints a Markdown table (milliseconds per call and torch / oneDNN ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [  # (rows, in features, out features)
    (8, 576, 576),
    (8, 576, 1536),
    (8, 1536, 576),
    (8, 576, 49152),
    (256, 576, 192),
    (256, 576, 1536),
    (256, 1536, 576),
]


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def measure_shape(dtype: torch.dtype, rows: int, fan_in: int, fan_out: int, repeats: int):
    """Milliseconds: (torch, oneDNN, oneDNN packed) forward, (torch, oneDNN) input gradient."""
    inner = torch.ops.mkldnn._linear_pointwise
    x = torch.randn(rows, fan_in, dtype=dtype)
    weight = torch.randn(fan_out, fan_in, dtype=dtype)
    grad = torch.randn(rows, fan_out, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return (
        median_ms(lambda: F.linear(x, weight), repeats),
        median_ms(lambda: inner(x, weight, None, "none", [], ""), repeats),
        median_ms(lambda: inner(x, packed, None, "none", [], ""), repeats),
        median_ms(lambda: grad @ weight, repeats),
        median_ms(lambda: inner(grad, weight.t(), None, "none", [], ""), repeats),
    )


def measure(dtype: torch.dtype, repeats: int) -> list[str]:
    lines = []
    for rows, fan_in, fan_out in SHAPES:
        forward, onednn, packed, backward, onednn_backward = measure_shape(
            dtype, rows, fan_in, fan_out, repeats
        )
        lines.append(
            f"| {str(dtype).removeprefix('torch.')} | {rows} x {fan_in} -> {fan_out} "
            f"| {forward:.3f} | {onednn:.3f} | {packed:.3f} | {forward / packed:.2f}x "
            f"| {backward:.3f} | {onednn_backward:.3f} | {backward / onednn_backward:.2f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "| dtype | rows x in -> out | torch ms | oneDNN ms | oneDNN packed ms "
        "| torch / packed | backward torch ms | backward oneDNN ms | torch / oneDNN |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes:
        for line in measure(getattr(torch, name), args.repeats):
            print(line, flush=True)


if __name__ == "__main__":
    main()
