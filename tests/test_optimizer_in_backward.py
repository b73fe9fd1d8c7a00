"""AdamW stepped inside the backward: the same weights as stepping after it, a gradient
alive only while its layer is differentiated, and the optimizer's state still its own."""

import pytest
import torch

from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.speedups.optimizer_in_backward import BackwardSteps


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 8),
        *[torch.nn.Linear(8, 8) for _ in range(4)],
        torch.nn.Linear(8, 11),
    )
    model[-1].weight = model[0].weight  # tied: two uses, one gradient
    return model


def _loss(model, ids):
    return torch.log_softmax(model(ids), -1).mean() ** 2


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def test_stepping_in_backward_equals_stepping_after_it():
    batches = [
        torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(i)) for i in range(6)
    ]
    plain, fused = _model(), _model()
    plain_optimizer, fused_optimizer = _adamw(plain), _adamw(fused)
    steps = BackwardSteps(fused_optimizer)
    for first, last in zip(batches[::2], batches[1::2], strict=True):  # 2 micro-batches a step
        for batch in (first, last):
            _loss(plain, batch).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
        _loss(fused, first).backward()  # accumulated, then included by the armed pass
        with steps.armed():
            _loss(fused, last).backward()
        assert all(p.grad is None for p in fused.parameters())
        fused_optimizer.step()  # what the armed pass did not reach: nothing here
    for (name, expected), got in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(expected, got), name


def test_gradients_are_freed_as_the_backward_goes():
    model = _model()
    steps = BackwardSteps(_adamw(model))
    alive = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(p.grad is not None for p in model.parameters()))
        )
    with steps.armed():
        _loss(model, torch.randint(0, 11, (3, 5))).backward()
    assert max(alive) <= 2  # a layer's weight and bias, never the whole model's


def test_parameters_the_armed_pass_does_not_reach_keep_their_gradient():
    """They are left for the optimizer's ordinary step; nothing is stepped outside the block."""
    model = _model()
    steps = BackwardSteps(_adamw(model))
    model[3](torch.ones(2, 8)).sum().backward()  # not armed: accumulated, not stepped
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert model[3].weight.grad is not None
    with steps.armed():
        model[4](torch.ones(2, 8)).sum().backward()
    assert model[4].weight.grad is None and not torch.equal(model[4].weight, before["4.weight"])
    assert model[3].weight.grad is not None and torch.equal(model[3].weight, before["3.weight"])


def test_state_survives_load_state_dict():
    """Resuming replaces the optimizer's state and groups; the per-weight steps follow."""
    batches = [
        torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]
    straight, resumed = _model(), _model()
    straight_steps = BackwardSteps(_adamw(straight))
    first_optimizer = _adamw(resumed)
    first_steps = BackwardSteps(first_optimizer)
    for model, steps in ((straight, straight_steps), (resumed, first_steps)):
        for batch in batches[:2]:
            with steps.armed():
                _loss(model, batch).backward()
    first_steps.remove()
    saved = first_optimizer.state_dict()
    optimizer = _adamw(resumed)
    steps = BackwardSteps(optimizer)
    optimizer.load_state_dict(saved)
    for model, steps_ in ((straight, straight_steps), (resumed, steps)):
        for batch in batches[2:]:
            with steps_.armed():
                _loss(model, batch).backward()
    for expected, got in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(expected, got)
    assert int(optimizer.state[resumed[1].weight]["step"]) == 4


def test_clipping_cannot_be_combined_with_it():
    with pytest.raises(ConfigError, match="max_grad_norm=1.0"):
        MAGRPOConfig(optimizer_in_backward=True, max_grad_norm=1.0)
    MAGRPOConfig(optimizer_in_backward=True, max_grad_norm=None)
