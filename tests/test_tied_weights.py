"""A weight shared by the input embedding and the output layer: one gradient buffer, the
same gradients as autograd's two separate uses."""

import pytest
import torch
import torch.nn.functional as F

from magrpo.losses import token_logprobs
from magrpo.speedups.chunked_logprobs import linear_token_logprobs
from magrpo.speedups.tied_weights import tied_gradient, tied_lookup


def _tied_pair(padding_idx=None):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8, padding_idx=padding_idx).double()
    head = torch.nn.Linear(8, 50, bias=False).double()
    head.weight = embedding.weight
    return embedding, head


def _loss(embedding, head, ids, targets, tied):
    """A small model between the lookup and the output layer, as in Policies.logprobs."""
    looked_up = embedding(ids) if tied is None else tied_lookup(embedding, ids, tied)
    hidden = torch.tanh(looked_up * 1.5)
    return (
        linear_token_logprobs(hidden, head.weight, targets, tied)
        .mul(torch.linspace(0.5, 1.5, len(ids), dtype=torch.float64))
        .sum()
    )


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_gradient_equals_two_separate_uses(padding_idx):
    embedding, head = _tied_pair(padding_idx)
    ids = torch.tensor([3, 5, 5, 7, 3, 49])  # repeated ids; 3 is the padding row when set
    targets = torch.tensor([5, 7, 3, 0, 1, 5])
    tied = tied_gradient(embedding, head)
    assert tied is not None

    (want,) = torch.autograd.grad(_loss(embedding, head, ids, targets, None), embedding.weight)
    (got,) = torch.autograd.grad(_loss(embedding, head, ids, targets, tied), embedding.weight)
    torch.testing.assert_close(got, want)
    # .backward(): the one buffer that reaches the weight's .grad
    _loss(embedding, head, ids, targets, tied).backward()
    torch.testing.assert_close(embedding.weight.grad, want)
    # and it matches plain logits through torch's own embedding and linear
    plain = token_logprobs(F.linear(torch.tanh(embedding(ids) * 1.5), head.weight), targets)
    (plain_grad,) = torch.autograd.grad(
        plain.mul(torch.linspace(0.5, 1.5, len(ids), dtype=torch.float64)).sum(),
        embedding.weight,
    )
    torch.testing.assert_close(got, plain_grad)


def test_untied_frozen_or_scaled_embeddings_keep_autograd_s_own_gradients():
    embedding, head = _tied_pair()
    untied = torch.nn.Linear(8, 50, bias=False).double()
    assert tied_gradient(embedding, untied) is None
    assert tied_gradient(embedding, None) is None
    with torch.no_grad():
        assert tied_gradient(embedding, head) is None

    class Scaled(torch.nn.Embedding):  # e.g. Gemma's embeddings scale their output
        def forward(self, ids):
            return super().forward(ids) * 2.0

    scaled = Scaled(50, 8).double()
    head.weight = scaled.weight
    assert tied_gradient(scaled, head) is None
    embedding.weight.requires_grad_(False)
    head.weight = embedding.weight
    assert tied_gradient(embedding, head) is None
