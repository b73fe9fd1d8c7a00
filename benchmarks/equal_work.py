"""A trainer that does the same work every step, for benchmarks.

Our trainer skips samples whose advantage is exactly 0 (their gradient is zero), so a step
whose rewards happen to be all equal skips the update entirely. That saves real time in
training but makes step times depend on the rewards drawn. With equal work, zero advantages
become 1e-30, so every completion is trained, as CoMLRL always does (same cost, no effect on
the weights worth speaking of).

Denormals: gradients scaled by 1e-30 fall below float32's normal range in the lower layers,
and CPU arithmetic on denormal numbers is slow (measured: a step whose groups all had equal
rewards took 24 s in the update instead of 3 s). CoMLRL multiplies by an exact 0 and never
meets them, so the trainer flushes denormals to zero (``torch.set_flush_denormal``): the same
arithmetic work as CoMLRL's, on zeros.
"""

from __future__ import annotations

import torch

from magrpo.trainer import MAGRPOTrainer


class EqualWorkTrainer(MAGRPOTrainer):
    def __init__(self, *args, **kwargs):
        torch.set_flush_denormal(True)
        super().__init__(*args, **kwargs)

    def build_samples(self, rollout):
        samples, metrics = super().build_samples(rollout)
        for sample in samples:
            if sample.advantage == 0.0:
                sample.advantage = 1e-30
        return samples, metrics
