"""The decode step's attention kernel against plain softmax attention written out in torch."""

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from magrpo.speedups.decode_attention import DecodeAttention, decode_attention_supported
from magrpo.speedups.llama_decode import _TorchAttention

pytestmark = pytest.mark.skipif(
    not decode_attention_supported(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)),
    reason="the decode kernels cannot be built here (see the log)",
)


def _caches(prompts, kv_heads, tokens, dim, seed=0):
    """Prompt keys and values laid out as transformers' cache holds them: [P, KV, W, D]
    views of [P, W, KV, D] memory, not contiguous. Left padding of a different length per
    prompt, at least one token attended."""
    generator = torch.Generator().manual_seed(seed)
    k, v = (
        torch.randn(prompts, tokens, kv_heads, dim, generator=generator).transpose(1, 2)
        for _ in range(2)
    )
    bias = torch.zeros(prompts, tokens)
    for p in range(prompts):
        bias[p, : (3 * p + 5) % tokens] = float("-inf")
    return k, v, bias


def _expected(projected, cos, sin, keys, values, bias, own_k, own_v, group, heads, scale):
    """Row by row, head by head: rotary on q and k, then softmax over the prompt's attended
    keys and the row's own keys so far (``own_k``/``own_v``: [rows, KV, n, D], rotated)."""
    kv_heads, dim = keys.shape[1], keys.shape[3]
    out = torch.empty(len(projected), heads * dim)
    for r, row in enumerate(projected):
        q = row[: heads * dim].view(heads, dim)
        q = q * cos[r] + rotate_half(q) * sin[r]
        p = r // group
        attended = bias[p] == 0
        for h in range(heads):
            g = h // (heads // kv_heads)
            k = torch.cat([keys[p, g][attended], own_k[r, g]])
            v = torch.cat([values[p, g][attended], own_v[r, g]])
            weights = torch.softmax((k @ q[h]) * scale, dim=0)
            out[r, h * dim : (h + 1) * dim] = weights @ v
    return out


@pytest.mark.parametrize(
    "prompts, group, heads, kv_heads, tokens, dim",
    [
        (2, 3, 6, 2, 37, 16),  # the tests' tiny model: prompt shorter than a key block
        (1, 4, 9, 3, 70, 64),  # SmolLM2's heads; keys not a multiple of 8 or 32
        (2, 2, 4, 4, 33, 72),  # no grouped heads; features past one 64-wide block
        (1, 1, 2, 1, 8, 128),
    ],
)
def test_kernel_equals_softmax_attention_step_after_step(
    prompts, group, heads, kv_heads, tokens, dim
):
    keys, values, bias = _caches(prompts, kv_heads, tokens, dim)
    scale = dim**-0.5
    steps, rows = 5, prompts * group
    attention = DecodeAttention(keys, values, bias, group, heads, steps, scale)
    generator = torch.Generator().manual_seed(1)
    own_k = torch.empty(rows, kv_heads, 0, dim)
    own_v = torch.empty(rows, kv_heads, 0, dim)
    for slot in range(steps):
        projected = 3 * torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)
        angles = torch.rand(rows, 1, dim // 2, generator=generator) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        k_new = projected[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
        k_new = k_new * cos + rotate_half(k_new) * sin
        v_new = projected[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        own_k = torch.cat([own_k, k_new[:, :, None]], dim=2)
        own_v = torch.cat([own_v, v_new[:, :, None]], dim=2)

        got = attention(projected, cos, sin, slot)

        expected = _expected(
            projected, cos[:, 0], sin[:, 0], keys, values, bias, own_k, own_v, group, heads, scale
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(attention.k_own[:, :, : slot + 1], own_k)
        assert torch.equal(attention.v_own[:, :, : slot + 1], own_v)


def test_kernel_equals_the_torch_path_and_ignores_masked_prompt_tokens():
    keys, values, bias = _caches(2, 3, 50, 64)
    args = (bias, 4, 9, 3, 0.125)
    kernel = DecodeAttention(keys, values, *args)
    in_torch = _TorchAttention(keys, values, *args)
    masked = values.clone()
    masked[bias.isinf()[:, None].expand_as(masked[..., 0])] = 1e6  # never attended
    on_masked = DecodeAttention(keys, masked, *args)
    for slot in range(3):
        projected = torch.randn(8, 15 * 64)
        cos, sin = torch.rand(8, 1, 64), torch.rand(8, 1, 64)
        got = kernel(projected, cos, sin, slot)
        torch.testing.assert_close(got, in_torch(projected, cos, sin, slot), rtol=1e-5, atol=1e-5)
        assert torch.equal(on_masked(projected, cos, sin, slot), got)


def test_what_the_kernel_cannot_read_is_refused_before_it_runs():
    keys, values, bias = _caches(1, 1, 10, 16)
    assert not decode_attention_supported(keys.bfloat16(), values.bfloat16())
    assert not decode_attention_supported(keys[..., :12], values[..., :12])  # not 8k features
    assert not decode_attention_supported(keys, values[:, :, :5])
    with pytest.raises(ValueError, match="unsupported caches"):
        DecodeAttention(keys.double(), values.double(), bias, 2, 2, 4, 0.25)
    with pytest.raises(ValueError, match="bias"):
        DecodeAttention(keys, values, bias[:, :5], 2, 2, 4, 0.25)
    attention = DecodeAttention(keys, values, bias, 2, 2, 4, 0.25)
    projected, cos = torch.zeros(2, 4 * 16), torch.zeros(2, 1, 16)
    attention(projected, cos, cos, 3)
    for bad in (
        (projected[:1], cos, cos, 0),  # a row short
        (projected, cos, cos, 4),  # past the own caches
        (projected.double(), cos, cos, 0),
        (projected, cos[..., :8], cos[..., :8], 0),
    ):
        with pytest.raises(ValueError, match="DecodeAttention: expected"):
            attention(*bad)
