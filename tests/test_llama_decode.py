"""The fused decode step against transformers' forward, on tiny random Llama and Qwen2 models."""

import types

import pytest
import torch
from magrpo_fixtures import tiny_model_path_per_architecture  # noqa: F401 - pytest fixture

import magrpo.speedups.llama_decode as llama_decode
from magrpo.forwards import last_position_pass, output_cache, position_ids
from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.speedups import blocked_matmul
from magrpo.speedups.decode_attention import DecodeAttention
from magrpo.speedups.llama_decode import LlamaDecodeStep, llama_decode_supported, separate_weights
from magrpo.speedups.onednn import onednn_supports

AGENTS = ["alice", "bob"]
PROMPTS = [("alice", "say some words again please"), ("bob", "task")]  # left padding
GROUP = 3


@pytest.fixture(params=["blocked", "onednn"])
def decode_kernel(request, monkeypatch):
    """The decode step's products (and with them its norms and attention) by each kernel,
    whichever this CPU would pick."""
    if request.param == "blocked" and blocked_matmul.library() is None:
        pytest.skip("the blocked-products kernel cannot be built here (see the log)")
    blocked = request.param == "blocked"
    monkeypatch.setattr(llama_decode, "blocked_matmul_pays", lambda rows: blocked)
    return request.param


@pytest.fixture
def policies(tiny_model_path_per_architecture, decode_kernel):  # noqa: F811
    torch.manual_seed(0)
    loaded = load_policies(AGENTS, [tiny_model_path_per_architecture] * 2)
    with torch.no_grad():  # adapters that change the logits, differently per agent
        for name, param in loaded.models[0].model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return loaded


def _prefilled_step(policies, prompts):
    """A LlamaDecodeStep after the prefill of ``prompts`` (GROUP rows each), as ``sample``
    builds it, and the first step's inputs."""
    backend = policies.models[0]
    network, head = policies.speedups.split(backend, backend.model)
    ids, mask, _ = backend.pad_batch(prompts)
    agents = [agent for agent, _ in PROMPTS]
    row_adapters = [backend.adapter[a] for a in agents for _ in range(GROUP)]
    assert llama_decode_supported(network, head, mask[:, :-1], backend.router)
    with torch.inference_mode(), backend.routed(agents):
        prefix = output_cache(last_position_pass(network, head, ids[:, :-1], mask[:, :-1]))
    step = LlamaDecodeStep(
        network, head, prefix, mask[:, :-1], GROUP, 8, backend.router, row_adapters
    )
    last = ids[:, -1:].repeat_interleave(GROUP, dim=0)
    positions = position_ids(mask)[:, -1:].repeat_interleave(GROUP, dim=0)
    return step, last, positions


def _reference_logits(policies, prompts, fed):
    """transformers' forward of prompt + tokens fed so far, row by row, through peft's own
    active adapter, without padding or cache: the last position's logits [rows, V]."""
    backend = policies.models[0]
    logits = []
    for row in range(len(fed)):
        agent, _ = PROMPTS[row // GROUP]
        backend.model.set_adapter(backend.adapter[agent])
        ids = torch.tensor([prompts[row // GROUP] + fed[row]])
        with torch.inference_mode():
            logits.append(backend.model(input_ids=ids).logits[0, -1].float())
    return torch.stack(logits)


def _decode(policies, steps=4):
    """Runs the fused step ``steps`` times on fixed random tokens: (fused, fed tokens)."""
    prompts = [policies.encode_prompt(agent, text) for agent, text in PROMPTS]
    step, ids, positions = _prefilled_step(policies, prompts)
    vocab = policies.models[0].model.config.vocab_size
    fed = [[prompts[row // GROUP][-1]] for row in range(len(ids))]
    fused = []
    backend = policies.models[0]
    agents = [agent for agent, _ in PROMPTS for _ in range(GROUP)]
    with torch.inference_mode(), backend.routed(agents):
        for _ in range(steps):
            fused.append(step.step(ids, positions).float())
            ids = torch.randint(3, vocab, (len(ids), 1))
            positions = positions + 1
            for row, token in enumerate(ids[:, 0].tolist()):
                fed[row].append(token)
    prompts_without_last = [p[:-1] for p in prompts]
    references = [
        _reference_logits(policies, prompts_without_last, [f[: k + 1] for f in fed])
        for k in range(steps)
    ]
    return fused, references


def test_fused_step_equals_transformers_forward_in_float32(policies):
    """Left-padded prompts of different lengths, G rows each, two adapters routed per row:
    every step's logits equal an unpadded, uncached forward through peft."""
    torch.manual_seed(1)
    fused, references = _decode(policies)
    for got, expected in zip(fused, references, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fused[0][0], fused[0][GROUP])  # the adapters do differ


def test_attention_runs_in_the_kernel_where_the_products_do(policies, decode_kernel):
    """The equality above then holds for both attentions: the kernel's and torch's."""
    prompts = [policies.encode_prompt(agent, text) for agent, text in PROMPTS]
    step, _, _ = _prefilled_step(policies, prompts)
    kernel = decode_kernel == "blocked"
    expected = DecodeAttention if kernel else llama_decode._TorchAttention
    assert {type(layer.attention) for layer in step.layers} == {expected}


@pytest.mark.skipif(
    not onednn_supports(torch.bfloat16), reason="this CPU has no oneDNN bfloat16 products"
)
def test_fused_step_in_bfloat16_differs_by_rounding_only(policies):
    """In bfloat16 both the fused step and transformers' forward round differently from
    float32; the fused step's error against float32 stays of the size of transformers' own."""
    torch.manual_seed(1)
    _, exact = _decode(policies)  # transformers in float32
    policies.models[0].model.to(torch.bfloat16)
    torch.manual_seed(1)
    fused, references = _decode(policies)
    for got, reference, truth in zip(fused, references, exact, strict=True):
        ours = (got - truth).abs().max()
        theirs = (reference - truth).abs().max()
        assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_sample_decodes_with_the_fused_step(policies, monkeypatch):
    calls = []
    original = LlamaDecodeStep.step

    def counted(self, ids, positions):
        calls.append(len(ids))
        return original(self, ids, positions)

    monkeypatch.setattr(LlamaDecodeStep, "step", counted)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    policies.sample(PROMPTS, GROUP, greedy)
    assert calls and set(calls) == {len(PROMPTS) * GROUP}


def test_unsupported_models_keep_the_transformers_forward(
    policies,
    tiny_model_path_per_architecture,  # noqa: F811
):
    backend = policies.models[0]
    network, head = policies.speedups.split(backend, backend.model)
    prompts = [policies.encode_prompt(agent, text) for agent, text in PROMPTS]
    _, mask, _ = backend.pad_batch(prompts)
    prefix_mask = mask[:, :-1]
    assert llama_decode_supported(network, head, prefix_mask, backend.router)
    # no separable output layer
    assert not llama_decode_supported(network, None, prefix_mask, backend.router)
    # LoRA layers without the router that can route them
    assert not llama_decode_supported(network, head, prefix_mask, None)
    # a prompt whose every prefix position is padding (a one-token prompt)
    padded = prefix_mask.clone()
    padded[1] = 0
    assert not llama_decode_supported(network, head, padded, backend.router)
    # full fine-tuning: a plain model, no adapters
    full = load_policies(AGENTS[:1], [tiny_model_path_per_architecture], finetune="full")
    model = full.models[0].model
    network, head = full.speedups.split(full.models[0], model)
    assert llama_decode_supported(network, head, prefix_mask, None)
    # another architecture
    architecture, network.config.model_type = network.config.model_type, "mistral"
    assert not llama_decode_supported(network, head, prefix_mask, None)
    network.config.model_type = architecture
    # sliding-window attention (Qwen2's and Mistral's option)
    network.layers[1].self_attn.sliding_window = 4
    assert not llama_decode_supported(network, head, prefix_mask, None)
    network.layers[1].self_attn.sliding_window = None
    # a dtype oneDNN does not run
    model.to(torch.float64)
    assert not llama_decode_supported(network, head, prefix_mask, None)


@pytest.fixture
def full_model(tiny_model_path_per_architecture, decode_kernel):  # noqa: F811
    """A fully fine-tuned model's policies, its weights each on memory of its own."""
    full = load_policies(AGENTS[:1], [tiny_model_path_per_architecture], finetune="full")
    separate_weights(full.models[0].model)
    return full


def _full_step(policies, reuse: bool):
    """A decode step (GROUP rows of one prompt) of a fully fine-tuned model, its inputs."""
    backend = policies.models[0]
    network, head = policies.speedups.split(backend, backend.model)
    ids, mask, _ = backend.pad_batch([policies.encode_prompt(AGENTS[0], "say words")])
    with torch.inference_mode():
        prefix = output_cache(last_position_pass(network, head, ids[:, :-1], mask[:, :-1]))
    step = LlamaDecodeStep(network, head, prefix, mask[:, :-1], GROUP, 8, reuse_weight_memory=reuse)
    last = ids[:, -1:].repeat_interleave(GROUP, dim=0)
    positions = position_ids(mask)[:, -1:].repeat_interleave(GROUP, dim=0)
    return step, last, positions


def _layer_weights(model) -> dict[str, torch.nn.Parameter]:
    named = model.named_parameters()
    return {n: p for n, p in named if "layers." in n and n.endswith("proj.weight")}


def _memory_reused(weight: torch.Tensor, before: torch.Tensor, kernel: str) -> bool:
    """Whether the decode step holds ``weight``'s memory: blocked in place (the blocked
    kernel) or freed for a packed copy (oneDNN)."""
    if kernel == "blocked":
        return weight.untyped_storage().nbytes() > 0 and not torch.equal(weight, before)
    return weight.untyped_storage().nbytes() == 0


def test_lent_weights_decode_the_same_and_come_back_exactly(full_model, decode_kernel):
    model = full_model.models[0].model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = {}
    for reuse in (False, True):
        step, ids, positions = _full_step(full_model, reuse)
        reused = [
            _memory_reused(w, before[n], decode_kernel) for n, w in _layer_weights(model).items()
        ]
        assert all(reused) if reuse else not any(reused)
        with torch.inference_mode():
            logits[reuse] = [step.step(ids, positions + k) for k in range(3)]
        step.restore_weights()
        for name, param in model.named_parameters():
            assert torch.equal(param, before[name]), name
    for reused, kept in zip(logits[True], logits[False], strict=True):
        assert torch.equal(reused, kept)
    # the output layer (tied to the embedding, read at every step) never gives its memory
    assert model.get_output_embeddings().weight.untyped_storage().nbytes() > 0


def test_weights_lent_before_packing_fails_come_back(full_model, decode_kernel, monkeypatch):
    model = full_model.models[0].model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # oneDNN packs each fused product once; the blocked kernel blocks each weight
    module, name, fail_at = (
        (blocked_matmul, "_transpose_blocks", 9)  # within layer 2's q, k, v
        if decode_kernel == "blocked"
        else (llama_decode, "pack_weight", 6)  # layer 2's o, after layer 1's memory was reused
    )
    original, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("out of memory")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        _full_step(full_model, reuse=True)
    for name, param in model.named_parameters():
        assert param.untyped_storage().nbytes() > 0, name
        assert torch.equal(param, before[name]), name


def test_weights_that_share_their_memory_are_not_lent_until_separated(
    tiny_model_path_per_architecture,  # noqa: F811
    decode_kernel,
):
    full = load_policies(AGENTS[:1], [tiny_model_path_per_architecture], finetune="full")
    model = full.models[0].model
    weights = list(_layer_weights(model).values())
    shared = torch.cat([w.detach().reshape(-1) for w in weights])  # one buffer, as on load
    offset = 0
    for weight in weights:
        weight.data = shared[offset : offset + weight.numel()].view_as(weight)
        offset += weight.numel()
    values = [w.detach().clone() for w in weights]
    step, _, _ = _full_step(full, reuse=True)
    pairs = zip(weights, values, strict=True)
    assert not any(_memory_reused(w, v, decode_kernel) for w, v in pairs)
    assert all(w.untyped_storage().nbytes() == shared.untyped_storage().nbytes() for w in weights)
    step.restore_weights()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    separate_weights(model)
    assert all(torch.equal(w, v) for w, v in zip(weights, values, strict=True))
    assert len({w.untyped_storage().data_ptr() for w in weights}) == len(weights)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    step, _, _ = _full_step(full, reuse=True)
    assert all(_memory_reused(w, v, decode_kernel) for w, v in zip(weights, values, strict=True))
    step.restore_weights()
    assert all(torch.equal(w, v) for w, v in zip(weights, values, strict=True))


def test_sampling_with_lent_weights_gives_the_same_completions(full_model):
    model = full_model.models[0].model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    requests = [(AGENTS[0], "say words"), (AGENTS[0], "task")]
    samples = {}
    for reuse in (False, True):
        full_model.speedups.reuse_weight_memory = reuse
        samples[reuse] = full_model.sample(requests, GROUP, params, seeds=[1, 2])
    assert [[c.completion_ids for c in r] for r in samples[True]] == [
        [c.completion_ids for c in r] for r in samples[False]
    ]
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_norms_run_in_the_kernel_only_as_transformers_defines_them(monkeypatch):
    """The blocked kernel's RMSNorm replaces transformers' own only: not a replaced forward,
    not another norm, not where the products are oneDNN's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if blocked_matmul.library() is None:
        pytest.skip("the blocked-products kernel cannot be built here (see the log)")
    monkeypatch.setattr(llama_decode, "blocked_matmul_pays", lambda rows: True)
    norm = LlamaRMSNorm(32)
    assert llama_decode._norm(norm, rows=4) is not norm
    replaced = LlamaRMSNorm(32)
    replaced.forward = lambda x: x
    assert llama_decode._norm(replaced, rows=4) is replaced
    layer_norm = torch.nn.LayerNorm(32)
    assert llama_decode._norm(layer_norm, rows=4) is layer_norm
    bfloat16 = LlamaRMSNorm(32).to(torch.bfloat16)
    assert llama_decode._norm(bfloat16, rows=4) is bfloat16
    monkeypatch.setattr(llama_decode, "blocked_matmul_pays", lambda rows: False)
    assert llama_decode._norm(norm, rows=4) is norm


def test_activations_run_in_the_kernel_only_for_transformers_silu(monkeypatch):
    """SwiGLU's ``silu(gate) * up`` by the kernel for transformers' and torch's SiLU only:
    not a replaced forward, not another activation, not bfloat16, not where the products
    are oneDNN's; elsewhere the model's own activation, applied the same way."""
    from transformers.activations import ACT2FN

    if blocked_matmul.library() is None:
        pytest.skip("the blocked-products kernel cannot be built here (see the log)")
    monkeypatch.setattr(llama_decode, "blocked_matmul_pays", lambda rows: True)

    def mlp(act_fn):
        return types.SimpleNamespace(act_fn=act_fn)

    kernel = blocked_matmul.silu_mul
    assert llama_decode._activation(mlp(ACT2FN["silu"]), 4, torch.float32) is kernel
    assert llama_decode._activation(mlp(torch.nn.SiLU()), 4, torch.float32) is kernel
    replaced = ACT2FN["silu"]
    replaced.forward = lambda x: x
    gelu = ACT2FN["gelu"]
    hidden = torch.randn(3, 16)
    for act_fn, dtype in (
        (replaced, torch.float32),
        (gelu, torch.float32),
        (ACT2FN["silu"], torch.bfloat16),
    ):
        activation = llama_decode._activation(mlp(act_fn), 4, dtype)
        assert activation is not kernel
        torch.testing.assert_close(activation(hidden), act_fn(hidden[:, :8]) * hidden[:, 8:])
    monkeypatch.setattr(llama_decode, "blocked_matmul_pays", lambda rows: False)
    assert llama_decode._activation(mlp(ACT2FN["silu"]), 4, torch.float32) is not kernel
