"""MAGRPO in one file: Multi-Agent Group Relative Policy Optimization (arXiv 2508.04652).

Read this file to see the whole algorithm; use ``python -m magrpo.train`` to train (the same
method, plus cross joints, multi-turn episodes, checkpoints, evaluation and speed-ups). Each
agent is its own Hugging Face model with a LoRA adapter. One training step, for one prompt:

1. every agent answers its own observation G times (``model.generate``);
2. joint action g is answer g of every agent ("aligned" joints); the env scores it with one
   joint reward R_g, shared by all agents;
3. advantages are group-relative: A_g = R_g - mean(R);
4. each agent takes one gradient step on the paper's loss
   L = -(1/G) sum_g A_g sum_t log pi(y_g,t | prompt, y_g,<t), where pi is the distribution the
   answers were sampled from (logits divided by the sampling temperature).

Runs against any PettingZoo parallel env whose observations and actions are text::

    python examples/magrpo_minimal.py                                   # TLDR sample posts
    python examples/magrpo_minimal.py --env coophumaneval --data coophumaneval.json
    python examples/magrpo_minimal.py --model path/to/model --steps 2 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import llm_marl_envs
from magrpo.models import resolve_model

SAMPLE_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "tldr_sample.jsonl"


@dataclass
class Args:
    env: str = "tldr"
    """an env id of llm_marl_envs"""
    data: str | None = str(SAMPLE_DATA)
    """the env's data: a local file or folder, or a Hugging Face dataset id"""
    model: str | None = None
    """a local model folder or a Hub id; None: SmolLM2-135M-Instruct"""
    seed: int = 0
    steps: int = 20
    """training steps, one prompt each"""
    group_size: int = 4
    """G: answers per agent per prompt"""
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.95
    learning_rate: float = 1e-4
    max_grad_norm: float = 1.0
    lora_rank: int = 8
    lora_alpha: float = 16.0


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        kind = {"int": int, "float": float}.get(field.type, str)  # "str | None": a string
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default)
    return Args(**vars(parser.parse_args(argv)))


def load_policy(path: str, args: Args) -> torch.nn.Module:
    """The model with a fresh LoRA adapter on q and v (peft starts B at zero: the adapted
    model begins exactly as the base model)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=["q_proj", "v_proj"]
    )
    return get_peft_model(model, lora)


def encode_prompt(tokenizer, observation: str) -> list[int]:
    """The observation as one user turn of the model's chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": observation}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_length(ids: list[int], tokenizer) -> int:
    """Tokens that belong to an answer: up to and including its first EOS. ``generate`` pads
    a row that ended early (at EOS or a stop string) with the pad token."""
    for position, token in enumerate(ids):
        if token == tokenizer.eos_token_id:
            return position + 1
        if token == tokenizer.pad_token_id:
            return position
    return len(ids)


@torch.no_grad()
def sample_answers(policy, tokenizer, prompt: list[int], args: Args, stop: list[str]):
    """G sampled answers to one prompt: their token ids (trimmed) and their text."""
    output = policy.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.max_new_tokens,
        num_return_sequences=args.group_size,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=stop or None,
        tokenizer=tokenizer,
    )
    rows = [row[len(prompt) :].tolist() for row in output]
    answers = [row[: answer_length(row, tokenizer)] for row in rows]
    texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
    return answers, texts


def magrpo_loss(policy, prompt, answers, advantages, temperature: float) -> torch.Tensor:
    """-(1/G) sum_g A_g sum_t log pi(y_g,t): one forward pass over the G answers to one prompt,
    with the logits divided by the temperature they were sampled at."""
    longest = max(len(a) for a in answers)
    input_ids = torch.tensor([prompt + a + [0] * (longest - len(a)) for a in answers])
    mask = torch.tensor([[1.0] * len(a) + [0.0] * (longest - len(a)) for a in answers])
    attention_mask = torch.cat([torch.ones(len(answers), len(prompt)), mask], dim=1).long()
    logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
    # position p predicts token p + 1: the answer's tokens are predicted from len(prompt) - 1 on
    answer_logits = logits[:, len(prompt) - 1 : -1] / temperature
    logprobs = answer_logits.log_softmax(-1).gather(-1, input_ids[:, len(prompt) :, None])[..., 0]
    sequence_logprobs = (logprobs * mask).sum(-1)
    return -(advantages * sequence_logprobs).sum() / len(answers)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the mean joint reward of every step."""
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    env = llm_marl_envs.make(args.env, data=args.data)
    agents = list(env.possible_agents)
    # where an answer is complete, e.g. the closing code fence (none for the writing tasks)
    formats = env.metadata.get("answer_format") or {}
    stops = {agent: list(formats.get(agent, {}).get("stop", [])) for agent in agents}
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policies = {agent: load_policy(path, args) for agent in agents}
    optimizers = {
        agent: torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate
        )
        for agent, policy in policies.items()
    }

    rewards_per_step = []
    for step in range(args.steps):
        # 1. every agent answers its own observation G times
        observations, _ = env.reset(seed=args.seed * 1_000_003 + step)
        prompts = {agent: encode_prompt(tokenizer, observations[agent]) for agent in agents}
        answers, texts = {}, {}
        for agent in agents:
            answers[agent], texts[agent] = sample_answers(
                policies[agent], tokenizer, prompts[agent], args, stops[agent]
            )

        # 2. joint action g = answer g of every agent, scored by one joint reward
        rewards = []
        for g in range(args.group_size):
            env.reset(seed=args.seed * 1_000_003 + step)
            _, reward, _, _, _ = env.step({agent: texts[agent][g] for agent in agents})
            rewards.append(reward[agents[0]])
        rewards = torch.tensor(rewards)

        # 3. group-relative advantages
        advantages = rewards - rewards.mean()

        # 4. one policy-gradient step per agent
        losses = {}
        for agent in agents:
            loss = magrpo_loss(
                policies[agent], prompts[agent], answers[agent], advantages, args.temperature
            )
            optimizers[agent].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policies[agent].parameters(), args.max_grad_norm)
            optimizers[agent].step()
            losses[agent] = loss.item()

        rewards_per_step.append(rewards.mean().item())
        print(
            f"step {step + 1}/{args.steps}  joint reward {rewards.mean():.3f} ± {rewards.std():.3f}"
            + "".join(f"  loss/{agent} {value:+.4f}" for agent, value in losses.items()),
            flush=True,
        )
    env.close()
    return rewards_per_step


if __name__ == "__main__":
    main()
