"""A decode step's attention by one AVX2 kernel call per layer, on CPU.

The fused decode step (``llama_decode``) attends in two blocks: the G rows of a prompt
attend together to the one copy of its keys and values, each row to its own generated
tokens. In torch that is two flash-attention calls merged by their log-sum-exps, plus the
rotary embedding, the cache writes and the reshapes between them: about 25 operators per
layer and 0.25 ms at SmolLM2's shapes (4 rows, 270 prompt tokens, one thread), for 1.4
million multiply-adds. ``csrc/decode_attention.cpp`` does all of it in one call (0.07 ms):
rotary on the new queries and key, the new key and value into the row's cache, one softmax
over prompt and own keys (nothing to merge), with each block of the prompt's keys and
values read once for all the queries of a prompt. Sampling: 1.19x with full fine-tuning
(two models decoding side by side, which also queue less for the interpreter), 1.24x with
LoRA (``benchmarks/decode_step.py --against torch-attention``).

It is built into the blocked-products library (``blocked_matmul.library``) and used where
that library runs the step's products, for float32 models whose head size is a multiple of
8; elsewhere the step keeps torch's operators.
"""

from __future__ import annotations

import ctypes

import torch

from magrpo.speedups.blocked_matmul import library

_pointer, _long = ctypes.c_void_p, ctypes.c_long


class _Caches(ctypes.Structure):
    """``AttentionCaches`` of ``csrc/decode_attention.cpp``."""

    _fields_ = [
        ("k_prompt", _pointer),
        ("v_prompt", _pointer),
        ("k_prompt_strides", _long * 3),
        ("v_prompt_strides", _long * 3),
        ("prompt_bias", _pointer),
        ("prompt_tokens", _long),
        ("k_own", _pointer),
        ("v_own", _pointer),
        ("own_strides", _long * 3),
        ("rows", _long),
        ("group", _long),
        ("heads", _long),
        ("kv_heads", _long),
        ("dim", _long),
        ("scale", ctypes.c_float),
    ]


def decode_attention_supported(k_prompt: torch.Tensor, v_prompt: torch.Tensor) -> bool:
    """Whether :class:`DecodeAttention` can attend over these prompt caches [P, KV, W, D]."""
    return (
        library() is not None
        and all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1
            for t in (k_prompt, v_prompt)
        )
        and k_prompt.shape == v_prompt.shape
        and k_prompt.shape[-1] % 8 == 0
    )


class DecodeAttention:
    """One layer's attention in a decode step: ``attention(projected, cos, sin, slot)`` ->
    [rows, heads * D].

    ``projected`` [rows, (heads + 2 KV) * D] holds each row's q, k and v before the rotary
    embedding (``cos``, ``sin``: [rows, 1, D] or [rows, D], as the model's rotary embedding
    gives them); ``slot`` is the step's index among the generated tokens. The call writes
    the rotated key and the value at ``slot`` of the row's own caches (``k_own``,
    ``v_own`` [rows, KV, max_new_tokens, D]) and attends to the prompt's keys where
    ``prompt_bias`` [P, W] is 0 (not -inf) and to the row's tokens 0 .. ``slot``. Rows are
    the prompts repeated ``group`` times (row r belongs to prompt r // group).
    """

    def __init__(
        self,
        k_prompt: torch.Tensor,
        v_prompt: torch.Tensor,
        prompt_bias: torch.Tensor,
        group: int,
        heads: int,
        max_new_tokens: int,
        scale: float,
    ):
        if not decode_attention_supported(k_prompt, v_prompt):
            raise ValueError("DecodeAttention: unsupported caches (see decode_attention_supported)")
        prompts, kv_heads, prompt_tokens, dim = k_prompt.shape
        if prompt_bias.shape != (prompts, prompt_tokens) or heads % kv_heads:
            raise ValueError(
                f"DecodeAttention: bias {tuple(prompt_bias.shape)} for caches "
                f"{tuple(k_prompt.shape)}, {heads} query heads for {kv_heads} key/value heads"
            )
        rows = prompts * group
        self.k_own = k_prompt.new_zeros(rows, kv_heads, max_new_tokens, dim)
        self.v_own = torch.zeros_like(self.k_own)
        # the kernel reads these by address: they live as long as the attention
        self._tensors = (k_prompt, v_prompt, prompt_bias.float().contiguous())
        self._caches = _Caches(
            k_prompt.data_ptr(),
            v_prompt.data_ptr(),
            (_long * 3)(*k_prompt.stride()[:3]),
            (_long * 3)(*v_prompt.stride()[:3]),
            self._tensors[2].data_ptr(),
            prompt_tokens,
            self.k_own.data_ptr(),
            self.v_own.data_ptr(),
            (_long * 3)(*self.k_own.stride()[:3]),
            rows,
            group,
            heads,
            kv_heads,
            dim,
            scale,
        )
        self._kernel = library().decode_attention
        self._caches_address = ctypes.addressof(self._caches)
        self._projected = (rows, (heads + 2 * kv_heads) * dim)
        self._out = (rows, heads * dim)
        self._dim = dim
        self._max_new_tokens = max_new_tokens

    def __call__(
        self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: int
    ) -> torch.Tensor:
        # the kernel checks no bounds: the shapes it reads, checked here
        rows, dim = self._projected[0], self._dim
        if (
            projected.shape != self._projected
            or projected.stride(1) != 1
            or not (projected.dtype == cos.dtype == sin.dtype == torch.float32)
            or cos.shape != sin.shape
            or cos.shape[-1] != dim
            or cos.numel() != rows * dim
            or not 0 <= slot < self._max_new_tokens
        ):
            raise ValueError(
                f"DecodeAttention: expected float32 projected {self._projected} with rows "
                f"of contiguous features, cos and sin [{rows}, 1, {dim}], slot < "
                f"{self._max_new_tokens}; got {projected.dtype} {tuple(projected.shape)}, "
                f"{tuple(cos.shape)} and {tuple(sin.shape)}, slot {slot}"
            )
        cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
        out = projected.new_empty(self._out)
        self._kernel(
            self._caches_address, projected.data_ptr(), projected.stride(0),
            cos.data_ptr(), sin.data_ptr(), dim, slot, out.data_ptr(), out.stride(0),
        )  # fmt: skip
        return out
