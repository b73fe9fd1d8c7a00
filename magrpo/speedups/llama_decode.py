"""A decode step for Llama (and Qwen2) models on CPU: fused products, prompts attended once
per group.

A decode step reads every weight of the model once for a handful of rows, so it is bound by
memory bandwidth, and transformers' forward adds about sixty small operators per layer on
top. The G samples of a prompt also each attend over their own copy of the prompt's keys and
values: with G = 4 and 64 new tokens after a 270-token prompt, two thirds of what attention
reads are copies. :class:`LlamaDecodeStep` runs the same arithmetic with less of both:

- the products that read one input (q, k, v; gate, up) are one product over their weights,
  prepared once per ``sample`` call: by the blocked kernel on AVX2 CPUs
  (``blocked_matmul``), else by oneDNN on the weights concatenated and packed
  (``onednn``); o and down add the residual inside the product;
- LoRA adapters, routed per row (``lora_routing``), add two small matmuls per fused product;
- the queries of a prompt's G rows attend together to the one copy of the prompt's keys
  and values, and each row to its own generated tokens: in one kernel call per layer where
  the blocked kernel runs (``decode_attention``: rotary, cache writes and one softmax over
  both), else as two flash-attention calls whose softmaxes are merged by their log-sum-exps
  ("cascade" attention).

It is the model's forward up to float rounding (summation order; the merge of the two
softmaxes), computed with the model's own rotary embedding, activation and RMSNorms (the
latter two as one kernel call each for transformers' SiLU and Llama/Qwen2 norms where the
blocked kernel runs: ``blocked_matmul.silu_mul``, ``rms_norm``). Where it does not apply
(another architecture, sliding-window attention, adapters that are not routed LoRA, GPU,
other dtypes), :func:`llama_decode_supported` says so and the caller keeps transformers'
forward.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from magrpo.speedups.blocked_matmul import (
    BlockedMatmul,
    blockable,
    blocked_matmul_pays,
    norm_weight_supported,
    rms_norm,
    silu_mul,
)
from magrpo.speedups.decode_attention import DecodeAttention, decode_attention_supported
from magrpo.speedups.heap import release_free_heap
from magrpo.speedups.onednn import inner_product, onednn_available, onednn_supports, pack_weight

_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# transformers' model types with Llama's decoder layer: Qwen2 differs by biases on q, k, v
# (fused like the weights) and an optional sliding window (not supported)
ARCHITECTURES = ("llama", "qwen2")


def llama_decode_supported(network, head, prefix_mask: torch.Tensor, router=None) -> bool:
    """Whether :class:`LlamaDecodeStep` can decode for ``network`` (a Llama or Qwen2
    decoder) and ``head`` (its output layer, None when the logits are not plain
    ``head(decoder(x))``) after a prefill whose attention mask is ``prefix_mask``.
    ``router``: the LoRA router of a shared base, the only way adapters are supported."""
    from peft.tuners.lora import LoraLayer

    config = getattr(network, "config", None)
    if head is None or getattr(config, "model_type", None) not in ARCHITECTURES:
        return False
    if getattr(config, "pretraining_tp", 1) > 1:
        return False
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in network.layers):
        return False  # the step attends to every token
    if not onednn_available(head.weight.device) or not onednn_supports(head.weight.dtype):
        return False
    if not bool(prefix_mask.any(-1).all()):  # a prompt with nothing to attend to in the prefix
        return False
    routed = set(router.layers) if router is not None else set()
    return all(module in routed for module in network.modules() if isinstance(module, LoraLayer))


def _base(linear: torch.nn.Module) -> torch.nn.Linear:
    return getattr(linear, "base_layer", linear)


def separate_weights(model: torch.nn.Module) -> None:
    """Give every parameter of ``model`` memory of its own, so that a decode step can reuse
    it (``reuse_weight_memory``). Weights loaded from a file often share one buffer, or map the
    file: a reused weight's memory would then stay allocated for the others' sake."""
    with torch.no_grad():
        for param in model.parameters():
            if not _owns_memory(param):
                param.data = param.data.clone(memory_format=torch.contiguous_format)


def _owns_memory(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is alone on its memory, which can then be freed and re-allocated."""
    storage = weight.untyped_storage()
    return (
        storage.resizable()
        and weight.is_contiguous()
        and weight.storage_offset() == 0
        and storage.nbytes() == weight.numel() * weight.element_size()
    )


class _FusedProduct:
    """Linear layers that read the same input, as one product plus their adapters.

    The product is :class:`BlockedMatmul` where it pays (``blocked_matmul``), else
    oneDNN's on a packed copy. ``reuse_memory``: the layers' own weights give their memory to
    the product until :meth:`restore_weights` (weights that share their memory with other
    tensors keep it): blocked in place, or freed while their packed copy lives.
    """

    def __init__(
        self,
        linears: Sequence[torch.nn.Module],
        rows: int,
        router,
        scales,
        reuse_memory: bool = False,
    ):
        bases = [_base(linear) for linear in linears]
        weights = [b.weight.detach() for b in bases]
        bias = None
        if any(b.bias is not None for b in bases):
            bias = torch.cat(
                [
                    b.bias.detach() if b.bias is not None else b.weight.new_zeros(len(b.weight))
                    for b in bases
                ]
            )
        self.lora = None
        adapted = [k for k, linear in enumerate(linears) if linear is not bases[k]]
        if adapted:
            # The adapters of all fused layers as one (A, B) pair: A stacked on the rank
            # dimension, B block-placed at each layer's output rows.
            starts = [0, *itertools.accumulate(len(w) for w in weights)]
            a_parts = []
            b_full = weights[0].new_zeros(starts[-1], len(adapted) * scales.shape[1])
            for n, k in enumerate(adapted):
                lora_a, lora_b = router.stacked(linears[k], weights[0].dtype)
                a_parts.append(lora_a)
                rank = lora_a.shape[0]
                b_full[starts[k] : starts[k + 1], n * rank : (n + 1) * rank] = lora_b
            self.lora = (
                torch.cat(a_parts),
                scales.to(weights[0].dtype).repeat(1, len(adapted)),
                b_full.t().contiguous(),
            )
        # last: once weights' memory is reused, nothing may fail before the caller holds the product
        in_place = [reuse_memory and _owns_memory(w) for w in weights]
        if blocked_matmul_pays(rows) and blockable(weights):
            self.product = BlockedMatmul(weights, bias, in_place=in_place)
        else:
            self.product = _PackedProduct(weights, rows, bias, in_place)

    def restore_weights(self) -> None:
        self.product.restore_weights()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.product(x, residual)
        if self.lora is not None:
            lora_a, scales, lora_b_t = self.lora
            y.addmm_(F.linear(x, lora_a).mul_(scales), lora_b_t)
        return y


class _PackedProduct:
    """The weights concatenated and packed for oneDNN; ``in_place[j]``: weight j's memory is
    freed while the packed copy lives."""

    def __init__(self, weights, rows: int, bias, in_place: Sequence[bool]):
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.weight = pack_weight(weight, rows)
        del weight
        starts = [0, *itertools.accumulate(len(w) for w in weights)]
        self.reused = [(w, starts[k], starts[k + 1]) for k, w in enumerate(weights) if in_place[k]]
        for reused_weight, _, _ in self.reused:
            reused_weight.untyped_storage().resize_(0)
        self.bias = bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return inner_product(x, self.weight, self.bias, residual)

    def restore_weights(self) -> None:
        """The reused weights, exactly as they were: oneDNN's packed layout converts back
        without rounding."""
        if not self.reused:
            return
        dense, self.weight = self.weight.to_dense(), None  # no longer callable
        for weight, start, stop in self.reused:
            weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            weight.copy_(dense[start:stop])
        self.reused = []


def _norm(module: torch.nn.Module, rows: int):
    """The decode step's ``module(x)``: transformers' own RMSNorm of Llama or Qwen2 in one
    kernel call where the blocked kernel runs (``blocked_matmul.rms_norm``, the same
    arithmetic), else the module."""
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm")
        and "forward" not in vars(module)  # not replaced (e.g. by a hub kernel)
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and weight is not None
        and norm_weight_supported(weight)
        and blocked_matmul_pays(rows)
    ):
        return functools.partial(rms_norm, weight=weight.detach(), eps=module.variance_epsilon)
    return module


def _gated(act_fn, hidden: torch.Tensor) -> torch.Tensor:
    half = hidden.shape[-1] // 2
    return act_fn(hidden[:, :half]) * hidden[:, half:]


def _activation(mlp: torch.nn.Module, rows: int, dtype: torch.dtype):
    """The decode step's ``act_fn(gate) * up`` of the fused gate/up product's rows: in one
    kernel call for transformers' SiLU where the blocked kernel runs
    (``blocked_matmul.silu_mul``), else the model's own activation."""
    act_fn = mlp.act_fn
    if (
        type(act_fn).__name__ in ("SiLUActivation", "SiLU")
        and type(act_fn).__module__ in ("transformers.activations", "torch.nn.modules.activation")
        and "forward" not in vars(act_fn)
        and dtype == torch.float32
        and blocked_matmul_pays(rows)
    ):
        return silu_mul
    return functools.partial(_gated, act_fn)


class _Layer(NamedTuple):
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_attention_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: _FusedProduct
    attention: DecodeAttention | _TorchAttention
    o: _FusedProduct
    gate_up: _FusedProduct
    activation: Callable[[torch.Tensor], torch.Tensor]  # [gate | up] rows -> act(gate) * up
    down: _FusedProduct


class LlamaDecodeStep:
    """One decode step of every row: ``step(ids [B, 1], positions [B, 1])`` -> logits [B, V].

    Keeps the prompts' keys/values (one copy per prompt, from the prefill's cache
    ``prefix_cache`` with mask ``prefix_mask`` [P, W]) and each row's generated ones; rows
    are the prompts repeated ``num_samples`` times, row i running ``adapters[i]`` of
    ``router``. Check :func:`llama_decode_supported` first.

    ``reuse_weight_memory``: the decoder layers' weights give their memory up to their products
    while the step lives (blocked in place, or freed for oneDNN's packed copies: one copy of
    the layers instead of two, 0.5 GiB for SmolLM2-135M in float32), and get it back,
    exact, from :meth:`restore_weights`, which must run before anything else reads them. The
    output layer keeps its weight: a tied embedding is read at every step.

    ``record_inputs``: every layer's input of every step is kept in ``inputs`` [layers,
    rows, max_new_tokens, hidden] (the update can start from them: ``sampled_states``).
    """

    def __init__(
        self,
        network,
        head,
        prefix_cache,
        prefix_mask,
        num_samples,
        max_new_tokens,
        router=None,
        adapters=(),
        reuse_weight_memory=False,
        record_inputs=False,
    ):
        config = network.config
        self.network = network
        rows = len(prefix_mask) * num_samples
        scales = router.row_scales(adapters, prefix_mask.device) if router is not None else None
        dtype = head.weight.dtype
        release_free_heap()  # the packed copies then take pages the update freed

        self._products: list[_FusedProduct] = []

        def fused(*linears, reuse_memory=reuse_weight_memory):
            self._products.append(_FusedProduct(linears, rows, router, scales, reuse_memory))
            return self._products[-1]

        prompt_bias = torch.zeros(prefix_mask.shape, dtype=dtype, device=prefix_mask.device)
        prompt_bias.masked_fill_(prefix_mask == 0, float("-inf"))

        def attention(layer, cached):
            """The layer's attention: by the kernel where it runs the products too."""
            kernel = blocked_matmul_pays(rows) and decode_attention_supported(
                cached.keys, cached.values
            )
            return (DecodeAttention if kernel else _TorchAttention)(
                cached.keys, cached.values, prompt_bias, num_samples,
                config.num_attention_heads, max_new_tokens, layer.self_attn.scaling,
            )  # fmt: skip

        try:
            self.layers = [
                _Layer(
                    _norm(layer.input_layernorm, rows),
                    _norm(layer.post_attention_layernorm, rows),
                    fused(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                    attention(layer, cached),
                    fused(layer.self_attn.o_proj),
                    fused(layer.mlp.gate_proj, layer.mlp.up_proj),
                    _activation(layer.mlp, rows, dtype),
                    fused(layer.mlp.down_proj),
                )
                for layer, cached in zip(network.layers, prefix_cache.layers, strict=True)
            ]
            self.head = fused(head, reuse_memory=False)
            self.norm = _norm(network.norm, rows)
        except BaseException:
            self.restore_weights()
            raise
        self.length = 0  # generated tokens held per row
        self.inputs = (
            head.weight.new_empty(len(self.layers), rows, max_new_tokens, config.hidden_size)
            if record_inputs
            else None
        )

    def restore_weights(self) -> None:
        """Restore the weights whose memory the packed copies used (``reuse_weight_memory``),
        freeing those copies as it goes: the step cannot run after."""
        for product in self._products:
            product.restore_weights()

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.network.embed_tokens(ids[:, 0])
        cos, sin = self.network.rotary_emb(x, positions)  # [B, 1, D]: broadcast over heads
        slot, self.length = self.length, self.length + 1
        for index, layer in enumerate(self.layers):
            if self.inputs is not None:
                self.inputs[index, :, slot] = x
            projected = layer.qkv(layer.input_norm(x))
            x = layer.o(layer.attention(projected, cos, sin, slot), residual=x)
            hidden = layer.gate_up(layer.post_attention_norm(x))
            x = layer.down(layer.activation(hidden), residual=x)
        return self.head(self.norm(x))


class _TorchAttention:
    """:class:`DecodeAttention` in torch operators, for where its kernel does not run.

    Softmax attention over prompt + own tokens, as two blocks merged by log-sum-exp: a row's
    query heads that share a key/value head become that head's query positions (one query
    token per head, so no causal order to keep); the prompt block also stacks the G rows of
    a prompt.
    """

    def __init__(self, k_prompt, v_prompt, prompt_bias, group, heads, max_new_tokens, scale):
        self.prompts, self.kv_heads, _, self.dim = k_prompt.shape
        self.group, self.heads, self.scale = group, heads, scale
        self.k_prompt, self.v_prompt = k_prompt, v_prompt
        self.prompt_bias = prompt_bias.view(self.prompts, 1, 1, -1)
        own_shape = (self.prompts * group, self.kv_heads, max_new_tokens, self.dim)
        self.k_own, self.v_own = k_prompt.new_zeros(own_shape), v_prompt.new_zeros(own_shape)

    def __call__(self, projected, cos, sin, slot) -> torch.Tensor:
        rows, heads, kv_heads, dim = len(projected), self.heads, self.kv_heads, self.dim
        qk = projected[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
        rotated = torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1)
        qk = torch.addcmul(qk * cos, rotated, sin)
        self.k_own[:, :, slot] = qk[:, heads:]
        self.v_own[:, :, slot] = projected[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        return self._attention(qk[:, :heads], slot + 1).view(rows, -1)

    def _attention(self, q: torch.Tensor, own: int) -> torch.Tensor:
        prompts, group = self.prompts, self.group
        kv_heads, per_kv, dim = self.kv_heads, self.heads // self.kv_heads, self.dim
        # [P*G, KV*per_kv, D] -> [P, KV, G*per_kv, D]
        q_prompt = (
            q.reshape(prompts, group, kv_heads, per_kv, dim)
            .transpose(1, 2)
            .reshape(prompts, kv_heads, group * per_kv, dim)
        )
        out_prompt, lse_prompt = _ATTENTION(
            q_prompt, self.k_prompt, self.v_prompt, attn_mask=self.prompt_bias, scale=self.scale
        )
        out_prompt = (
            out_prompt.view(prompts, kv_heads, group, per_kv, dim)
            .transpose(1, 2)
            .reshape(-1, kv_heads, per_kv, dim)
        )
        lse_prompt = (
            lse_prompt.view(prompts, kv_heads, group, per_kv)
            .transpose(1, 2)
            .reshape(-1, kv_heads, per_kv, 1)
        )
        out_own, lse_own = _ATTENTION(
            q.reshape(-1, kv_heads, per_kv, dim),
            self.k_own[:, :, :own],
            self.v_own[:, :, :own],
            scale=self.scale,
        )
        # softmax over both blocks = each block's softmax, weighted by its share of the mass
        share = torch.sigmoid(lse_prompt - lse_own[..., None]).to(out_own.dtype)
        return torch.lerp(out_own, out_prompt, share)
