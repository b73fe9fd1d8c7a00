"""Run N training steps of CoMLRL's MAGRPO trainer and print one JSON line per step.

This script runs inside CoMLRL's own virtual environment (``benchmarks/.venv-comlrl``, made
by ``compare_comlrl.py``); CoMLRL is never a dependency of this project. It reads the
prompts, the data order and the reward from this repository (``llm_marl_envs``, which needs
no torch), so both trainers see the same prompts in the same order and pay the same reward
cost: the reward of a joint action is ``CodingTask.evaluate(...).joint_reward``, exactly what
``env.step`` computes for our trainer (structure, syntax and the sandboxed tests).

CoMLRL 1.4.3 on CPU, as its authors' examples run it: one model object per agent (LoRA:
a peft model per agent, each with its own full copy of the base), HF ``generate`` with
``num_return_sequences=G``, one forward + backward pass per completion, AdamW per agent.
Settings for CPU (see docs/benchmarks.md): ``pad_token`` = ``<|endoftext|>`` (SmolLM2's eos
and pad are the same token otherwise), a single turn, ``eval_interval=0``,
``rollout_buffer_size=1`` (one update per prompt, like ours), W&B off.

Output, one JSON object per line on stdout:
  {"event": "loaded", "seconds": ...}
  {"event": "step", "step": k, "seconds": ..., "generate_seconds": ..., "reward_seconds": ...,
   "update_seconds": ..., "generated_tokens": ..., "reward_mean": ..., "rss_mb": ...}
  {"event": "done", "maxrss_mb": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="This repository (for llm_marl_envs: prompts, data order, reward).")
    p.add_argument("--model", required=True, help="Local model folder (SmolLM2-135M-Instruct).")
    p.add_argument("--data", required=True, help="CoopHumanEval JSON file.")
    p.add_argument("--env", default="coophumaneval-v2")
    p.add_argument("--split", default="train")
    p.add_argument("--indices", required=True,
                   help="Comma-separated dataset indices, one per step (our trainer's order).")
    p.add_argument("--finetune", choices=("lora", "full"), default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-target-modules", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="Weights dtype of every agent model (bfloat16: the Hub checkpoint's).")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-token", default="<|endoftext|>",
                   help="Pad token (must differ from eos for CoMLRL with SmolLM2).")
    return p.parse_args(argv)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, args.repo)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from comlrl.trainers.reinforce.magrpo import MAGRPOConfig, MAGRPOTrainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llm_marl_envs

    started = time.perf_counter()
    env = llm_marl_envs.make(args.env, data=args.data, split=args.split, max_turns=1)
    agents = list(env.possible_agents)
    items = []
    for index in (int(i) for i in args.indices.split(",")):
        observations, _ = env.reset(seed=0, options={"index": index})
        record = dict(env.item)
        record.update({f"obs_{a}": str(observations[a]) for a in agents})
        record["index"] = index
        items.append(record)
    task = env.task

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = args.pad_token
    eos_id = tokenizer.eos_token_id

    def load_agent():
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        )
        if args.finetune == "lora":
            from peft import LoraConfig, get_peft_model

            targets = args.lora_target_modules
            config = LoraConfig(
                r=args.lora_rank,
                lora_alpha=args.lora_alpha,
                lora_dropout=0.0,
                target_modules="all-linear" if targets == ["all-linear"] else targets,
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, config)
        return model

    models = [load_agent() for _ in agents]

    timers = {"generate": 0.0, "reward": 0.0, "update": 0.0, "tokens": 0, "rewards": []}

    def reward(*completions, batch_items=None):
        t0 = time.perf_counter()
        item = batch_items[0]
        actions = {a: c[0] for a, c in zip(agents, completions, strict=True)}
        value = float(task.evaluate(item, actions).joint_reward)
        timers["reward"] += time.perf_counter() - t0
        timers["rewards"].append(value)
        return [value]

    formatters = [(lambda item, a=a: item[f"obs_{a}"]) for a in agents]
    config = MAGRPOConfig(
        num_train_epochs=1,
        agent_learning_rate=args.learning_rate,
        logging_steps=1,
        num_agents=len(agents),
        num_generations=args.group_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        num_turns=1,
        discount=1.0,
        joint_mode="aligned",
        early_termination_threshold=None,
        eval_interval=0,
        rollout_buffer_size=1,
        advantage_normalization=False,  # the paper's mean baseline, as our default
        advantage_mode="mean",
    )
    trainer = MAGRPOTrainer(
        agents=models,
        num_agents=len(agents),
        tokenizer=tokenizer,
        reward_func=reward,
        formatters=formatters,
        wandb_config=None,
        args=config,
    )

    generate = trainer._generate_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        timers["generate"] += time.perf_counter() - t0
        # Tokens up to and including the first EOS: the same count as our trainer's.
        for tokens in out["completion_input_ids"][0]:
            row = tokens.tolist()
            timers["tokens"] += row.index(eos_id) + 1 if eos_id in row else len(row)
        return out

    trainer._generate_completions = timed_generate
    update = trainer._update_from_samples

    def timed_update(*a, **kw):
        t0 = time.perf_counter()
        update(*a, **kw)
        timers["update"] += time.perf_counter() - t0

    trainer._update_from_samples = timed_update
    for model in trainer.agents:
        model.train()
    emit(event="loaded", seconds=time.perf_counter() - started, agents=agents,
         finetune=args.finetune, dtype=args.dtype, threads=torch.get_num_threads(),
         trainable=[sum(p.numel() for p in m.parameters() if p.requires_grad)
                    for m in trainer.agents])

    for step, item in enumerate(items, start=1):
        timers.update(generate=0.0, reward=0.0, update=0.0, tokens=0, rewards=[])
        t0 = time.perf_counter()
        trainer._train_step_returns(item)
        seconds = time.perf_counter() - t0
        emit(
            event="step",
            step=step,
            index=item["index"],
            seconds=seconds,
            generate_seconds=timers["generate"],
            reward_seconds=timers["reward"],
            update_seconds=timers["update"],
            generated_tokens=timers["tokens"],
            reward_mean=sum(timers["rewards"]) / max(len(timers["rewards"]), 1),
            rss_mb=rss_mb(),
        )
    emit(event="done", maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
