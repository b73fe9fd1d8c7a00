"""What the trainer learns from: log-probs at the sampling temperature (the probability the
sampler itself drew with), and answers that end where the env says they are complete."""

from __future__ import annotations

import torch
from magrpo_fixtures import build_tiny_model

from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.rollout import Completion

TEMPERATURE = 0.5
DRAWS = 4000


def first_token_distribution(policies, prompt_ids, vocabulary, temperature):
    """exp(log-prob) of every one-token completion, as the trainer computes it."""
    completions = [Completion("alice", "", prompt_ids, [token], False) for token in vocabulary]
    with torch.no_grad():
        batch = policies.logprobs(completions, temperature=temperature)
    return batch.logprobs[:, 0].exp()


def test_tempered_logprobs_match_what_the_sampler_draws(tmp_path):
    torch.manual_seed(0)
    policies = load_policies(["alice", "bob"], [str(build_tiny_model(tmp_path / "tiny"))] * 2)
    model = policies.models[0].model
    with torch.no_grad():  # a peaked distribution, so that T = 0.5 and T = 1 differ clearly
        model.get_output_embeddings().weight.mul_(40.0)
    (samples,) = policies.sample(
        [("alice", "say words")], DRAWS, SamplingParams(1, TEMPERATURE, top_p=1.0)
    )
    vocabulary = list(range(model.get_output_embeddings().weight.shape[0]))
    drawn = torch.bincount(
        torch.tensor([c.completion_ids[0] for c in samples]), minlength=len(vocabulary)
    ).double() / DRAWS
    prompt_ids = samples[0].prompt_ids
    tempered = first_token_distribution(policies, prompt_ids, vocabulary, TEMPERATURE).double()
    plain = first_token_distribution(policies, prompt_ids, vocabulary, 1.0).double()
    assert abs(float(tempered.sum()) - 1.0) < 1e-4
    distance = 0.5 * (drawn - tempered).abs().sum()  # total variation
    assert distance < 0.04, distance
    assert 0.5 * (drawn - plain).abs().sum() > 4 * distance  # temperature 1 is another law


def test_temperature_one_is_the_models_own_distribution(tmp_path):
    policies = load_policies(["alice", "bob"], [str(build_tiny_model(tmp_path / "tiny"))] * 2)
    prompt_ids = policies.encode_prompt("alice", "say words")
    completion = Completion("alice", "", prompt_ids, [7, 8, 9], False)
    model = policies.models[0].model
    with torch.no_grad():
        ours = policies.logprobs([completion]).logprobs[0]
        ids = torch.tensor([prompt_ids + [7, 8, 9]])
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits.double() / 1.0, -1)[range(3), [7, 8, 9]]
    torch.testing.assert_close(ours.double(), expected, atol=1e-4, rtol=0)


def test_answers_end_at_their_agents_stop_string(tmp_path):
    """The decode loop stops a row at the token that completes its agent's stop string, and
    the completion (ids and text) ends there: what is trained is what the env receives."""
    from magrpo.answers import completion_from_ids

    policies = load_policies(["alice", "bob"], [str(build_tiny_model(tmp_path / "tiny"))] * 2)
    tokenizer = policies.models[0].tokenizer
    free = SamplingParams(12, 1.0)
    (plain,) = policies.sample([("alice", "say words")], 8, free, seeds=[3])
    stop_word = tokenizer.decode(plain[0].completion_ids[1:2]).strip()
    stopping = SamplingParams(12, 1.0, stop={"alice": (stop_word,)})
    (stopped,) = policies.sample([("alice", "say words")], 8, stopping, seeds=[3])
    for before, after in zip(plain, stopped, strict=True):
        assert before.completion_ids[: len(after.completion_ids)] == after.completion_ids
        if stop_word in before.text:
            assert after.finished and after.text.rstrip().endswith(stop_word)
            assert stop_word not in tokenizer.decode(after.completion_ids[:-1])
        else:
            assert after.completion_ids == before.completion_ids
    ids = tokenizer("apple egg ice", add_special_tokens=False)["input_ids"]
    cut = completion_from_ids("alice", [1], ids, [2], tokenizer, stop=("egg",))
    assert cut.completion_ids == ids[:2] and cut.finished
