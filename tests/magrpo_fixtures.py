"""Tiny offline models and a tiny text env for the magrpo tests (no downloads).

* ``build_tiny_model(folder)``: a word-level tokenizer (pad == eos == ``<|im_end|>`` like
  SmolLM2, with a chat template that also contains that token) and a random
  ``LlamaForCausalLM`` (hidden 64, 2 layers; ``architecture="qwen2"``: a
  ``Qwen2ForCausalLM``), saved to ``folder``.
* ``WordGameEnv``: a 2-agent multi-turn text ParallelEnv. Joint reward = fraction of
  agent alice's words that are vowel-initial + 0.5 when bob writes more words than alice;
  deterministic, deep-copyable, with named reward parts.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from gymnasium import spaces
from pettingzoo import ParallelEnv

from magrpo.rollout import Completion

WORDS = [
    "apple",
    "egg",
    "ice",
    "owl",
    "up",
    "art",
    "end",
    "in",
    "on",
    "use",
    "bat",
    "cat",
    "dog",
    "fish",
    "gold",
    "hat",
    "jam",
    "kit",
    "lamp",
    "map",
    "net",
    "pen",
    "quiz",
    "rat",
    "sun",
    "top",
    "van",
    "web",
    "yak",
    "zip",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "user",
    "assistant",
    "say",
    "words",
    "more",
    "again",
    "feedback",
    "turn",
    "reward",
    "task",
]
SPECIALS = ["<pad_unused>", "<|im_start|>", "<|im_end|>", "<unk>", "\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} \n {{ m['content'] }} <|im_end|> \n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant \n {% endif %}"
)


def build_tokenizer(byte_level: bool = False):
    """A word-level tokenizer over WORDS; ``byte_level``: a byte-level BPE trained on them
    instead, the kind transformers requires for Qwen2 models (it loads ``Qwen2Tokenizer``
    for them, whatever the saved tokenizer class)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if byte_level:
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
        )
        core.train_from_iterator(WORDS + [f" {word}" for word in WORDS], trainer)
    else:
        vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<|im_end|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0, **config_overrides):
    """A random LlamaForCausalLM (hidden 64, 2 layers) sized to ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaConfig, LlamaForCausalLM, tokenizer, seed, config_overrides)


def tiny_qwen2(tokenizer, seed: int = 0, **config_overrides):
    """A random Qwen2ForCausalLM of the same size: Llama's layout plus biases on q, k and v
    (random here, not zero, so that they count)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _tiny(
        Qwen2Config,
        Qwen2ForCausalLM,
        tokenizer,
        seed,
        {"use_sliding_window": False, **config_overrides},
    )
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.normal_(std=0.5)
    return model


def _tiny(config_class, model_class, tokenizer, seed: int, config_overrides: dict):
    import torch

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    return model_class(config_class(**{**settings, **config_overrides}))


TINY_MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2}


def build_tiny_model(
    folder: str | Path, seed: int = 0, architecture: str = "llama", **config_overrides
) -> Path:
    tokenizer = build_tokenizer(byte_level=architecture == "qwen2")
    folder = Path(folder)
    TINY_MODELS[architecture](tokenizer, seed, **config_overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session", params=sorted(TINY_MODELS))
def tiny_model_path_per_architecture(request, tmp_path_factory) -> str:
    """A tiny model of each architecture with a fast path of its own (``llama_decode``)."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return str(build_tiny_model(folder, architecture=request.param))


def policies_to_compare(model_path: str, finetune: str):
    """(policies, agents) for pass-equality tests: one fully fine-tuned agent, or two LoRA
    agents on a routed shared base whose adapters are non-trivial and differ (peft
    initialises lora_B to zero)."""
    import torch

    from magrpo.loading import load_policies

    torch.manual_seed(0)
    agents = ["alice"] if finetune == "full" else ["alice", "bob"]
    policies = load_policies(agents, [model_path] * len(agents), finetune=finetune)
    with torch.no_grad():
        for name, param in policies.models[0].model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return policies, agents


def completions_of_two_prompts(policies, agents: list[str]) -> list[Completion]:
    """Three completions of two prompts, ``agents[0]``'s and ``agents[-1]``'s, of different
    lengths (one ends with EOS): a log-prob batch with padding and a shared prompt."""
    eos = policies.models[0].tokenizer.eos_token_id
    prompts = [
        policies.encode_prompt(agents[0], "say words"),
        policies.encode_prompt(agents[-1], "a task"),
    ]
    return [
        Completion(agents[0], "", prompts[0], [10, 11, 12, eos], True),
        Completion(agents[-1], "", prompts[1], [13, 14], False),
        Completion(agents[0], "", prompts[0], [15, 16, 17, 18, 19], False),
    ]


class WordGameEnv(ParallelEnv):
    """Two agents, text in, text out; reward is a deterministic function of both texts."""

    metadata = {"name": "word_game_v0"}
    PROMPTS = ["say words", "say more words", "task one", "task two", "words again", "say four"]

    def __init__(self, max_turns: int = 1, num_items: int | None = 6):
        self.possible_agents = ["alice", "bob"]
        self.agents: list[str] = []
        self.max_turns = max_turns
        if num_items is not None:
            self.num_items = num_items
        self.turn = 0
        self.prompt = ""

    @functools.cache  # noqa: B019
    def observation_space(self, agent):
        return spaces.Text(max_length=4096)

    @functools.cache  # noqa: B019
    def action_space(self, agent):
        return spaces.Text(max_length=4096)

    def reset(self, seed=None, options=None):
        index = (options or {}).get("index")
        if index is None:
            index = (seed or 0) % len(self.PROMPTS)
        self.prompt = self.PROMPTS[index % len(self.PROMPTS)]
        self.turn = 0
        self.agents = list(self.possible_agents)
        return {a: f"{self.prompt} {a}" for a in self.agents}, {a: {} for a in self.agents}

    @staticmethod
    def score(text_a: str, text_b: str) -> dict[str, float]:
        words_a, words_b = text_a.split(), text_b.split()
        vowels = sum(w[0] in "aeiou" for w in words_a) / max(len(words_a), 1)
        return {"vowels": round(vowels, 6), "longer": 0.5 if len(words_b) > len(words_a) else 0.0}

    def step(self, actions):
        parts = self.score(actions["alice"], actions["bob"])
        reward = sum(parts.values())
        self.turn += 1
        done = self.turn >= self.max_turns
        observations = {
            a: f"{self.prompt} again {' '.join(actions[a].split()[:3])} feedback {a}"
            for a in self.agents
        }
        rewards = {a: reward for a in self.agents}
        terminations = {a: done for a in self.agents}
        truncations = {a: False for a in self.agents}
        infos = {a: {"reward_parts": dict(parts)} for a in self.agents}
        if done:
            self.agents = []
        return observations, rewards, terminations, truncations, infos
