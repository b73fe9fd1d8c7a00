"""Policies on tiny random Llama and Qwen2 models: batching, masks, adapter isolation,
standard saving."""

import pytest
import torch
from magrpo_fixtures import tiny_model_path_per_architecture  # noqa: F401 - pytest fixture

from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.rollout import Completion

AGENTS = ["alice", "bob"]


@pytest.fixture
def tiny_model_path(tiny_model_path_per_architecture):  # noqa: F811
    return tiny_model_path_per_architecture


@pytest.fixture
def policies(tiny_model_path):
    torch.manual_seed(0)
    loaded = load_policies(AGENTS, [tiny_model_path] * 2)
    with torch.no_grad():  # make the adapters non-trivial and different
        for name, param in loaded.models[0].model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return loaded


def test_shared_base_one_adapter_per_agent(policies):
    assert len(policies.models) == 1 and policies.models[0].mode == "shared_lora"
    alice = policies.named_trainable_parameters("alice")
    bob = policies.named_trainable_parameters("bob")
    assert alice and bob and not set(alice) & set(bob)
    assert all(".alice." in name for name in alice)
    assert all(p.requires_grad for p in [*alice.values(), *bob.values()])


@pytest.fixture(params=["fused", "transformers"])
def decode_path(request, monkeypatch):
    """Decode with the fused Llama step (the default here) or with transformers' forward."""
    if request.param == "transformers":
        monkeypatch.setattr("magrpo.speedups.auto.llama_decode_supported", lambda *args: False)
    return request.param


@pytest.mark.usefixtures("decode_path")
def test_mixed_adapter_batch_equals_per_agent_generation(policies):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    requests = [("alice", "say words"), ("bob", "say words")]
    together = policies.sample(requests, 2, greedy)
    alone = [policies.sample([request], 2, greedy)[0] for request in requests]
    for joint, single in zip(together, alone, strict=True):
        assert [c.completion_ids for c in joint] == [c.completion_ids for c in single]
    assert together[0][0].completion_ids != together[1][0].completion_ids  # adapters differ


@pytest.mark.usefixtures("decode_path")
def test_seeded_samples_do_not_depend_on_the_batch(policies):
    """With per-request seeds, what a request draws is fixed by its seed: batched with other
    prompts or alone (as on another data-parallel process), the samples are the same."""
    hot = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9)
    requests = [("alice", "say words"), ("bob", "a longer task prompt here"), ("alice", "x")]
    seeds = [5, 6, 7]
    together = policies.sample(requests, 3, hot, seeds)
    alone = [policies.sample([r], 3, hot, [s])[0] for r, s in zip(requests, seeds, strict=True)]
    for joint, single in zip(together, alone, strict=True):
        assert [c.completion_ids for c in joint] == [c.completion_ids for c in single]
    assert len({tuple(c.completion_ids) for c in together[0]}) > 1  # samples of a group differ
    reseeded = policies.sample(requests[:1], 3, hot, [8])[0]
    assert [c.completion_ids for c in reseeded] != [c.completion_ids for c in together[0]]


@pytest.mark.usefixtures("decode_path")
def test_models_sampled_side_by_side_draw_what_they_draw_alone(
    tiny_model_path, monkeypatch, torch_threads
):
    """Separate models (full fine-tuning) with seeds decode in worker threads, one torch
    thread each: the samples are those of each model sampled on its own."""
    import magrpo.speedups.auto

    torch.manual_seed(0)
    full = load_policies(AGENTS, [tiny_model_path] * 2, finetune="full")
    with torch.no_grad():  # two different models
        next(full.models[1].model.parameters()).add_(0.5)
    calls = []
    run = magrpo.speedups.auto.run_side_by_side
    monkeypatch.setattr(
        magrpo.speedups.auto, "run_side_by_side", lambda jobs: calls.append(1) or run(jobs)
    )
    hot = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9)
    requests = [("alice", "say words"), ("bob", "a longer task prompt here")]
    torch_threads(2)
    together = full.sample(requests, 3, hot, [5, 6])
    assert torch.get_num_threads() == 2  # the workers' shares did not leak out
    assert calls == [1]
    alone = [full.sample([r], 3, hot, [s])[0] for r, s in zip(requests, [5, 6], strict=True)]
    assert calls == [1]  # one model per call: nothing to run side by side
    for joint, single in zip(together, alone, strict=True):
        assert [c.completion_ids for c in joint] == [c.completion_ids for c in single]


def test_models_sampled_one_after_the_other_hold_one_decoding_state(tiny_model_path, monkeypatch):
    """Without side-by-side sampling a model's decoding state (its packed weights) is gone
    before the next model packs its own."""
    import weakref

    import magrpo.speedups.auto

    full = load_policies(AGENTS, [tiny_model_path] * 2, finetune="full")
    full.speedups.side_by_side = False
    made, alive_before = [], []

    class Recorded(magrpo.speedups.auto.LlamaDecodeStep):
        def __init__(self, *args, **kwargs):
            alive_before.append(sum(ref() is not None for ref in made))
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(magrpo.speedups.auto, "LlamaDecodeStep", Recorded)
    hot = SamplingParams(max_new_tokens=4, temperature=1.0)
    full.sample([("alice", "say words"), ("bob", "a task")], 2, hot, [1, 2])
    assert alive_before == [0, 0]


@pytest.mark.usefixtures("decode_path")
def test_shared_prefill_generation_equals_plain_generate(policies):
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    requests = [("alice", "say words again"), ("bob", "task")]  # different prompt lengths
    plain = [policies.sample([request], 1, greedy)[0][0].completion_ids for request in requests]
    shared = policies.sample(requests, 3, greedy)  # prompt prefilled once, cache repeated
    for expected, group in zip(plain, shared, strict=True):
        assert [c.completion_ids for c in group] == [expected] * 3


@pytest.mark.usefixtures("decode_path")
def test_decoding_equals_transformers_generate_with_peft_adapter(policies):
    """Our decode loop (routed adapters, static cache, shared prefill) against the reference:
    ``generate`` on peft's own active adapter, one agent and one prompt at a time."""
    backend = policies.models[0]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    requests = [("alice", "say words again"), ("bob", "task")]  # different prompt lengths
    ours = policies.sample(requests, 2, greedy)
    for (agent, text), group in zip(requests, ours, strict=True):
        backend.model.set_adapter(backend.adapter[agent])
        prompt = torch.tensor([policies.encode_prompt(agent, text)])
        with torch.no_grad():
            output = backend.model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=10,
                do_sample=False,
                pad_token_id=backend.pad_id,
                eos_token_id=backend.eos_ids,
            )
        expected = output[0, prompt.shape[1] :].tolist()
        expected = expected[: len(group[0].completion_ids)]
        assert [c.completion_ids for c in group] == [expected] * 2


def test_logprobs_equal_a_plain_forward_with_peft_adapter(policies):
    """Shared prompt cache, routed adapters and the chunked output layer against a plain
    forward of prompt + completion through peft's active adapter and a log-softmax."""
    backend = policies.models[0]
    eos = backend.tokenizer.eos_token_id
    prompts = [policies.encode_prompt("alice", "say"), policies.encode_prompt("bob", "a task")]
    completions = [
        Completion("alice", "", prompts[0], [10, 11, 12, eos], True),
        Completion("bob", "", prompts[1], [13, 14], False),
        Completion("bob", "", prompts[1], [15, 16, 17, 18, 19], False),
    ]
    batch = policies.logprobs(completions)
    for row, completion in enumerate(completions):
        backend.model.set_adapter(backend.adapter[completion.agent])
        ids = torch.tensor([completion.prompt_ids + completion.completion_ids])
        with torch.no_grad():
            logits = backend.model(input_ids=ids).logits[0, len(completion.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1)
        expected = expected.gather(-1, torch.tensor(completion.completion_ids)[:, None])[:, 0]
        length = len(completion.completion_ids)
        assert torch.allclose(batch.logprobs[row, :length], expected, atol=1e-5)
        assert not batch.logprobs[row, length:].any()


def test_full_fine_tuning_gradients_equal_a_plain_forward(tiny_model_path, monkeypatch):
    """Every weight's gradient of the log-probs, the tied embedding's included (one lookup
    for prompts and completions, the output layer's gradient written slice by slice and
    handed to the lookup), against plain autograd through transformers' forward and a
    log-softmax."""
    from transformers import AutoModelForCausalLM

    import magrpo.speedups.auto as agents

    lookups = []
    tied_lookup = agents.tied_lookup
    monkeypatch.setattr(agents, "tied_lookup", lambda *a: lookups.append(1) or tied_lookup(*a))
    full = load_policies(["alice"], [tiny_model_path], finetune="full")
    model = full.models[0].model
    eos = full.models[0].tokenizer.eos_token_id
    prompts = [full.encode_prompt("alice", "say words"), full.encode_prompt("alice", "task")]
    completions = [
        Completion("alice", "", prompts[0], [10, 11, 12, eos], True),
        Completion("alice", "", prompts[1], [13, 14], False),
        Completion("alice", "", prompts[0], [15, 16, 17], False),
    ]
    (full.logprobs(completions).logprobs.sum() * 0.5).backward()
    assert lookups == [1]  # the tied weight's one gradient buffer
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert plain.get_input_embeddings().weight is plain.get_output_embeddings().weight  # tied
    total = 0.0
    for completion in completions:
        ids = torch.tensor([completion.prompt_ids + completion.completion_ids])
        logits = plain(input_ids=ids).logits[0, len(completion.prompt_ids) - 1 : -1]
        targets = torch.tensor(completion.completion_ids)[:, None]
        total = total + torch.log_softmax(logits, -1).gather(-1, targets).sum()
    (total * 0.5).backward()
    ours = dict(model.named_parameters())
    for name, param in plain.named_parameters():
        torch.testing.assert_close(ours[name].grad, param.grad, rtol=1e-4, atol=1e-5)


def test_chunked_output_layer_gradients_match_full_logits(monkeypatch):
    import magrpo.speedups.chunked_logprobs as chunked_logprobs
    from magrpo.losses import token_logprobs

    monkeypatch.setattr(chunked_logprobs, "LOGIT_CHUNK_ELEMENTS", 3 * 50)  # 3 rows per chunk
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs.linear_token_logprobs(h, w, targets), (hidden, weight)
    )
    chunked = chunked_logprobs.linear_token_logprobs(hidden, weight, targets)
    full = token_logprobs(hidden @ weight.T, targets)
    assert torch.allclose(chunked, full, atol=1e-6)


def test_chunked_output_layer_in_bfloat16_stays_within_its_precision(monkeypatch):
    """Lower-precision weights: the logits' gradients are rounded to bfloat16 before the
    products, and each vocabulary slice's weight gradient is written in bfloat16."""
    import magrpo.speedups.chunked_logprobs as chunked_logprobs
    from magrpo.losses import token_logprobs

    monkeypatch.setattr(chunked_logprobs, "LOGIT_CHUNK_ELEMENTS", 3 * 50)  # several slices
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    token_logprobs(hidden @ weight.T, targets).sum().backward()
    low = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight)]
    out = chunked_logprobs.linear_token_logprobs(*low, targets)
    assert out.dtype == torch.float32
    out.sum().backward()
    for have, want in zip(low, (hidden, weight), strict=True):
        assert have.grad.dtype == torch.bfloat16
        error = (have.grad.double() - want.grad).abs().max() / want.grad.abs().max()
        assert error < 2e-2


def test_chat_template_and_eos(policies):
    tokenizer = policies.models[0].tokenizer
    prompt = policies.encode_prompt("alice", "say words")
    words = tokenizer.decode(prompt).split()
    assert words[:4] == ["<|im_start|>", "user", "say", "words"]
    # pad == eos == <|im_end|> also occurs inside the prompt: ends come from lengths
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token_id in prompt
    (group,) = policies.sample([("alice", "say words")], 6, SamplingParams(12, 1.0))
    for completion in group:
        eos_positions = [i for i, t in enumerate(completion.completion_ids) if t == 2]
        assert eos_positions in ([], [len(completion.completion_ids) - 1])
        assert completion.finished == bool(eos_positions)


def test_batched_logprobs_equal_single_and_ignore_padding(policies):
    eos = policies.models[0].tokenizer.eos_token_id
    prompts = [
        policies.encode_prompt("alice", "say"),
        policies.encode_prompt("bob", "task one two"),
    ]
    completions = [
        Completion("alice", "", prompts[0], [10, 11, eos], True),
        Completion("bob", "", prompts[1], [12, 13, 14, 15, 16, 17], False),
        Completion("alice", "", prompts[1], [eos], True),
    ]
    batch = policies.logprobs(completions)
    assert batch.mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]]
    for row, completion in enumerate(completions):
        single = policies.logprobs([completion])
        length = len(completion.completion_ids)
        assert torch.allclose(batch.logprobs[row, :length], single.logprobs[0], atol=1e-5)
    # gradient flows only through each row's own adapter, and is finite despite left padding
    (batch.logprobs[1] * batch.mask[1]).sum().backward()
    alice = policies.named_trainable_parameters("alice").values()
    bob = policies.named_trainable_parameters("bob").values()
    assert all(p.grad is None or not p.grad.any() for p in alice)
    assert any(p.grad is not None and p.grad.any() for p in bob)
    assert all(torch.isfinite(p.grad).all() for p in bob if p.grad is not None)


def test_reference_is_base_model(policies, tiny_model_path):
    from transformers import AutoModelForCausalLM

    prompt = policies.encode_prompt("alice", "say")
    completion = Completion("alice", "", prompt, [10, 11, 12], False)
    reference = policies.logprobs([completion], reference=True).logprobs
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    logits = base(torch.tensor([prompt + [10, 11, 12]])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor([10, 11, 12])]
    assert torch.allclose(reference[0], expected, atol=1e-5)
    assert not torch.allclose(policies.logprobs([completion]).logprobs[0], expected, atol=1e-3)


def test_saved_adapters_load_with_peft(policies, tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = policies.save_agent("bob", tmp_path / "adapters")
    assert folder == tmp_path / "adapters" / "bob"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    loaded = PeftModel.from_pretrained(base, folder)
    ours = policies.named_trainable_parameters("bob")
    theirs = {
        n.replace(".default.", ".bob."): p for n, p in loaded.named_parameters() if "lora_" in n
    }
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_models_without_a_separable_output_layer_use_the_plain_forward(policies):
    """The fallback for models whose logits are not lm_head(decoder(x)) (forced here) gives
    the same samples and log-probs as the split path."""
    backend = policies.models[0]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    requests = [("alice", "say words"), ("bob", "a task")]
    completions = [group[0] for group in policies.sample(requests, 2, greedy)]
    split = policies.logprobs(completions)
    assert policies.speedups.split(backend, backend.model)[1] is not None
    policies.speedups._splits[id(backend.model)] = (backend.model, None)
    assert [g[0] for g in policies.sample(requests, 2, greedy)] == completions
    plain = policies.logprobs(completions)
    assert torch.allclose(plain.logprobs * plain.mask, split.logprobs * split.mask, atol=1e-5)
