"""Every agent's rows through its own LoRA adapter in one pass over one shared base model.

peft can mix adapters in a batch (``adapter_names=``), but each adapted layer then gathers
the rows of every adapter, runs them through it and scatters the results back, with the row
lists rebuilt in Python at every layer: ~700 small ops per forward for 2 agents and 60
adapted layers. At a decode step of 8 rows on CPU that overhead is a large part of the step.
Here the adapters' A and B matrices are stacked once per pass and a row's adapter is a mask
over the stacked rank dimension (zero outside its own block, the adapter's scaling inside):
per layer two small matmuls, a multiply and an add, for any mix of rows. It is exact (the
other blocks contribute exact zeros), differentiable, and uses peft's own parameters, so
saving, loading and the optimizer are unchanged. With a bfloat16 base the adapters run in
bfloat16 like the base (peft would upcast the activations to the adapters' float32): no
float32 copy of every adapted layer's input is kept for the backward pass.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F


class AdapterRouter:
    """Routes each row of a peft model's batch to one of its plain LoRA adapters (or none).

    Outside :meth:`route` the layers behave exactly as peft's.
    """

    def __init__(self, model: torch.nn.Module, adapter_names: Sequence[str]):
        from peft.tuners.lora import Linear as LoraLinear

        self.names = list(adapter_names)
        self.layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if not self.layers:
            raise ValueError("the model has no LoRA linear layers to route")
        first = self.layers[0]
        self.ranks = [first.r[name] for name in self.names]
        self.scalings = [first.scaling[name] for name in self.names]
        for layer in self.layers:
            self._check(layer)
            layer.forward = functools.partial(self._forward, layer, layer.forward)
        self._row_scales: torch.Tensor | None = None  # [B, sum(ranks)] while routing
        self._base_only = False
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _check(self, layer) -> None:
        for name, rank, scaling in zip(self.names, self.ranks, self.scalings, strict=True):
            dropout = layer.lora_dropout[name]
            if (
                name not in layer.lora_A
                or name in getattr(layer, "lora_variant", {})
                or layer.r[name] != rank
                or layer.scaling[name] != scaling
                or not (isinstance(dropout, torch.nn.Identity) or dropout.p == 0)
            ):
                raise ValueError(
                    f"adapter {name!r} of {layer.__class__.__name__} is not a plain LoRA "
                    "with the same rank and scaling in every layer and no dropout; routing "
                    "needs that (use peft's adapter_names= for other adapter types)"
                )

    @contextlib.contextmanager
    def route(self, adapters: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Within the block, row i of every forward uses adapter ``adapters[i]`` (None: base).

        The stacked weights are built once per block, so a block must not span an optimizer
        step.
        """
        if all(adapter is None for adapter in adapters):
            self._base_only = True
        else:
            self._row_scales = self.row_scales(adapters, device)
        try:
            yield
        finally:
            self._row_scales, self._base_only = None, False
            self._stacked.clear()

    def row_scales(self, adapters: Sequence[str | None], device: torch.device) -> torch.Tensor:
        """[B, sum(ranks)]: row i's adapter scaling on its block of the stacked rank
        dimension, zero elsewhere (None: zero everywhere, the base model)."""
        scales = torch.zeros(len(adapters), sum(self.ranks))
        starts = [sum(self.ranks[:k]) for k in range(len(self.names))]
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                k = self.names.index(adapter)
                scales[row, starts[k] : starts[k] + self.ranks[k]] = self.scalings[k]
        return scales.to(device)

    def _forward(self, layer, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self._base_only:
            return layer.base_layer(x, *args, **kwargs)
        if self._row_scales is None:
            return peft_forward(x, *args, **kwargs)
        result = layer.base_layer(x, *args, **kwargs)
        lora_a, lora_b = self.stacked(layer, x.dtype)
        scales = self._row_scales.to(x.dtype).view(len(x), *[1] * (x.dim() - 2), -1)
        return result + F.linear(F.linear(x, lora_a) * scales, lora_b).to(result.dtype)

    def stacked(self, layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapters' A and B stacked, in the activations' dtype (as autocast would run
        them; the float32 parameters stay the optimizer's copy and get float32 gradients).
        """
        stacked = self._stacked.get(id(layer))
        if stacked is None:
            stacked = (
                torch.cat([layer.lora_A[name].weight for name in self.names], dim=0).to(dtype),
                torch.cat([layer.lora_B[name].weight for name in self.names], dim=1).to(dtype),
            )
            self._stacked[id(layer)] = stacked
        return stacked
