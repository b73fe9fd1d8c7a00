"""Advantages and losses against hand-computed values; masks exclude padding after EOS."""

import math

import pytest
import torch

from magrpo.advantages import available_advantages, compute_advantages, register_advantage
from magrpo.losses import (
    LossNormalizer,
    completion_length,
    completion_mask,
    get_loss,
    policy_token_loss,
    register_loss,
    token_logprobs,
)

RETURNS = torch.tensor([1.0, 2.0, 3.0, 6.0])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("magrpo", [-2.0, -1.0, 0.0, 3.0]),
        # leave-one-out means: (11/3, 10/3, 3, 2)
        ("rloo", [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0]),
        ("remax", [-5.0, -4.0, -3.0, 0.0]),
        ("reinforce", [1.0, 2.0, 3.0, 6.0]),
    ],
)
def test_advantages_by_hand(name, expected):
    got = compute_advantages(RETURNS, name, normalize_std=False)
    assert got.tolist() == pytest.approx(expected)


def test_std_normalisation():
    std = RETURNS.std().item()  # unbiased, 2.160...
    got = compute_advantages(RETURNS, "magrpo", normalize_std=True)
    assert got.tolist() == pytest.approx([a / (std + 1e-6) for a in [-2.0, -1.0, 0.0, 3.0]])
    constant = compute_advantages(torch.ones(4), "magrpo", normalize_std=True)
    assert constant.tolist() == [0.0] * 4  # zero-variance group: no NaN


def test_register_custom_advantage():
    @register_advantage("test_median")
    def median(returns):
        return returns - returns.median()

    assert "test_median" in available_advantages()
    assert compute_advantages(RETURNS, "test_median", False).tolist() == [-1.0, 0.0, 1.0, 4.0]


def test_completion_length_counts_first_eos_only():
    eos = [2]
    assert completion_length([5, 6, 2, 2, 2], eos) == 3  # EOS counts, padding after does not
    assert completion_length([2, 7], eos) == 1
    assert completion_length([5, 6, 7], eos) == 3  # cut at max_new_tokens
    mask = completion_mask(torch.zeros(3, 5, dtype=torch.long), torch.tensor([3, 1, 5]))
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), expected, atol=1e-6)


# Two sequences of one agent: log-probs, advantages, mask (row 0 has 2 real tokens).
LOGP = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([2.0, -1.0])
NORM = LossNormalizer(num_sequences=2, num_tokens=5, max_new_tokens=4)


def test_loss_reductions_by_hand():
    token_loss, kl = policy_token_loss(LOGP, ADV)
    assert kl is None
    # -A * logp: row 0: 2*(1+2) = 6 (the -9 after EOS is masked); row 1: -1*(0.5+0.5+1) = -2
    assert get_loss("sequence_sum")(token_loss, MASK, NORM).item() == pytest.approx((6 - 2) / 2)
    assert get_loss("token_mean")(token_loss, MASK, NORM).item() == pytest.approx(4 / 5)
    assert get_loss("sequence_mean")(token_loss, MASK, NORM).item() == pytest.approx(
        (6 / 2 + -2 / 3) / 2
    )
    assert get_loss("dr_grpo")(token_loss, MASK, NORM).item() == pytest.approx(4 / (2 * 4))


def test_micro_batches_sum_to_full_batch_loss():
    token_loss, _ = policy_token_loss(LOGP, ADV)
    for name in ("sequence_sum", "token_mean", "sequence_mean", "dr_grpo"):
        loss = get_loss(name)
        full = loss(token_loss, MASK, NORM)
        split = loss(token_loss[:1], MASK[:1], NORM) + loss(token_loss[1:], MASK[1:], NORM)
        assert split.item() == pytest.approx(full.item())


def test_sequence_sum_gradient_is_paper_formula():
    logp = LOGP.clone().requires_grad_(True)
    token_loss, _ = policy_token_loss(logp, ADV)
    get_loss("sequence_sum")(token_loss, MASK, NORM).backward()
    # d/dlogp of -(1/G) sum_g A_g sum_t logp = -A_g / G on real tokens, 0 on padding
    expected = -(ADV[:, None] / 2) * MASK
    assert torch.equal(logp.grad, expected)


def test_clipped_surrogate_and_kl_by_hand():
    logp = torch.tensor([[math.log(0.5)], [math.log(0.5)]])
    old = torch.tensor([[math.log(0.25)], [math.log(0.25)]])  # ratio 2
    adv = torch.tensor([1.0, -1.0])
    loss, _ = policy_token_loss(logp, adv, old, clip_epsilon=0.2)
    # A>0: min(2*1, 1.2*1) = 1.2 -> -1.2 ; A<0: min(-2, -1.2) = -2 -> 2
    assert loss.squeeze(-1).tolist() == pytest.approx([-1.2, 2.0])
    ref = torch.tensor([[math.log(0.25)], [math.log(0.5)]])
    loss, kl = policy_token_loss(logp, adv, ref_logprobs=ref, kl_coef=0.1)
    delta = math.log(0.25) - math.log(0.5)
    k3 = math.exp(delta) - delta - 1
    assert kl.squeeze(-1).tolist() == pytest.approx([k3, 0.0])
    assert loss.squeeze(-1).tolist() == pytest.approx([-math.log(0.5) + 0.1 * k3, math.log(0.5)])


def test_register_custom_loss():
    @register_loss("test_sum")
    def plain_sum(token_loss, mask, norm):
        return (token_loss * mask).sum()

    token_loss, _ = policy_token_loss(LOGP, ADV)
    assert get_loss("test_sum")(token_loss, MASK, NORM).item() == pytest.approx(4.0)


def test_fast_logsumexp_matches_torch_on_wide_logits():
    from magrpo.numerics import logsumexp

    logits = torch.randn(5, 49152) * 30  # most shifted terms underflow float32
    logits[0, 7] = 200.0
    assert torch.allclose(logsumexp(logits)[:, 0], torch.logsumexp(logits, -1), atol=1e-5)
