"""The optimizer step fused into the backward: each parameter is stepped as soon as its
gradient is complete, and its gradient freed.

A full fine-tuning update otherwise holds a gradient for every weight of the model before
the optimizer runs (one more copy of the model: 0.5 GiB for SmolLM2-135M in float32). Here
no more than the layers still being differentiated hold gradients at once. The optimizer is
the same: each parameter's step is the one the optimizer would make, on the optimizer's own
state (so saving and resuming it is unchanged). What cannot work is anything that needs all
gradients before any step: clipping by the global norm, summing gradients over processes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch


class BackwardSteps:
    """Steps ``optimizer``'s parameters from inside backward passes run in :meth:`armed`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._armed = False
        self._single: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}
        self._handles = [
            param.register_post_accumulate_grad_hook(functools.partial(self._step, index))
            for index, group in enumerate(optimizer.param_groups)
            for param in group["params"]
        ]

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Backward passes in the block step the parameters whose gradients they complete.
        Run only an optimizer step's last backward armed: gradients accumulated by earlier
        ones are included, and parameters the armed pass does not reach keep theirs for the
        optimizer's ordinary ``step()``."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _step(self, index: int, param: torch.nn.Parameter) -> None:
        """Steps ``param``, of the optimizer's group ``index``."""
        if not self._armed:
            return
        group = self.optimizer.param_groups[index]
        single = self._single.get(param)
        if single is None:  # an optimizer of the same class over ``param`` alone
            kind = type(self.optimizer)
            accepted = inspect.signature(kind).parameters  # a group also has derived keys
            settings = {k: v for k, v in group.items() if k in accepted and k != "params"}
            single = self._single[param] = kind([param], **settings)
        # the whole optimizer's current state and settings (``load_state_dict`` replaces both)
        single.state = self.optimizer.state
        single.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
        single.step()
        param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
