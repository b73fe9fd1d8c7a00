"""A trainer that does the same work every step, for benchmarks.

Our trainer skips samples whose advantage is exactly 0 (their gradient is zero), so a step
whose rewards happen to be all equal skips the update entirely. That saves real time in
training but makes step times depend on the rewards drawn. With equal work, zero advantages
become 1e-30, so every completion is trained, as CoMLRL always does (same cost, no effect on
the weights worth speaking of).
"""

from __future__ import annotations

from magrpo.trainer import MAGRPOTrainer


class EqualWorkTrainer(MAGRPOTrainer):
    def build_samples(self, rollout):
        samples, metrics = super().build_samples(rollout)
        for sample in samples:
            if sample.advantage == 0.0:
                sample.advantage = 1e-30
        return samples, metrics
