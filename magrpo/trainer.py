"""The training loop: rollout -> advantages -> loss -> optimizer step.

``MAGRPOTrainer`` works with any PettingZoo ParallelEnv whose observations and actions are
text. What a step computes from its rollout (advantages, the policy loss, a critic) is the
run's ``Algorithm`` (``magrpo.algorithms``: MAGRPO by default, IAC, MAAC or a registered
one); advantage estimators and loss reductions are registries too, so a new algorithm
usually needs no subclass (see ``examples/custom_algorithm.py`` and
``examples/third_party_algorithm.py``). Each phase is also a method a subclass may override
(``collect``, ``build_samples``, ``update``, ``evaluate``).

The metrics each step logs are listed in docs/training.md ("Logged metrics").
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from magrpo.algorithms import TrainSample, get_algorithm
from magrpo.checkpoint import (
    ADAPTERS_DIR,
    MODELS_DIR,
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from magrpo.checkpoint import set_rng_state as restore_rng_state
from magrpo.config import ConfigError, MAGRPOConfig
from magrpo.data_order import DataOrder, total_steps
from magrpo.distributed import DataParallel
from magrpo.env_contract import (
    answer_budget,
    answer_stops,
    check_horizon,
    check_state,
    check_text_env,
)
from magrpo.loading import agent_devices, load_policies
from magrpo.logging_utils import MetricsLogger, NullMetricsLogger, progress_bar
from magrpo.losses import LossNormalizer, get_loss
from magrpo.policies import Policies, SamplingParams
from magrpo.rollout import RolloutResult, rollout_metrics, run_rollout
from magrpo.speedups import speedups_for

logger = logging.getLogger(__name__)

__all__ = ["MAGRPOTrainer", "TrainResult", "TrainSample"]


@dataclass(frozen=True)
class AgentTotals:
    sequences: float
    tokens: float
    finished: float


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    last_reward: float
    best_reward: float
    last_eval_reward: float | None
    adapters_dir: Path
    metrics_path: Path
    history: list[dict[str, Any]] = field(default_factory=list)


class MAGRPOTrainer:
    """Train one policy per agent of ``env`` with MAGRPO (see ``MAGRPOConfig``)."""

    def __init__(
        self,
        config: MAGRPOConfig,
        env: Any,
        eval_env: Any | None = None,
        policies: Policies | None = None,
        model_resolver: Callable[[str | None], str] | None = None,
    ):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.agents = check_text_env(env)
        if config.max_new_tokens is None:
            # A copy rather than dataclasses.replace, which would validate the config again and
            # repeat the warnings it gave when it was built.
            config = copy.copy(config)
            config.max_new_tokens = answer_budget(env)
        self.config = config
        self.env = env
        self.eval_env = eval_env
        check_horizon(env, config.num_turns)
        algorithm = get_algorithm(config.algorithm)
        if algorithm.reads_state:
            check_state(env, config.algorithm)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.parallel = DataParallel(self.accelerator)
        if config.prompts_per_step % self.parallel.world_size:
            raise ConfigError(
                f"prompts_per_step={config.prompts_per_step} is the global batch and must be a "
                f"multiple of the {self.parallel.world_size} training processes, so that every "
                "process gets the same number of episodes: change --prompts-per-step or the "
                "number of processes."
            )
        if config.generation_backend == "vllm":
            from magrpo.vllm_sampler import import_vllm, start_vllm

            import_vllm()
        self.speedups = speedups_for(config)
        self.speedups.check_config(
            config, self.parallel.world_size, getattr(self.accelerator, "scaler", None) is not None
        )
        set_seed(config.seed)
        self.model_paths: list[str] = []  # filled when the trainer loads the models itself
        if policies is not None:
            policies.speedups = self.speedups  # ready-made policies run with this config's
        self.policies = policies or self._load_policies(model_resolver)
        missing = [a for a in self.agents if a not in self.policies.model_of]
        if missing:
            raise ConfigError(
                f"The given policies have no model for agent(s) {missing}; the env's agents are "
                f"{self.agents}."
            )
        for agent in self.agents:
            self.parallel.broadcast_parameters(
                self.policies.named_trainable_parameters(agent).values()
            )
        self.optimizers = {
            agent: self.accelerator.prepare_optimizer(
                _adamw(
                    list(self.policies.named_trainable_parameters(agent).values()),
                    config.learning_rate,
                    config.weight_decay,
                ),
                device_placement=False,  # states stay with their agent's parameters
            )
            for agent in self.agents
        }
        self.algorithm = algorithm(config, self.policies, self.parallel)
        self.speedups.prepare_run(self.policies, self.optimizers)
        self.vllm = None
        if config.generation_backend == "vllm":  # start_vllm was imported above
            self.vllm = start_vllm(self.policies, self.model_paths, config)
        num_items = getattr(env, "num_items", None)
        self.data_order = DataOrder(
            num_items if isinstance(num_items, int) and not isinstance(num_items, bool) else None,
            config.seed,
        )
        self.total_steps = total_steps(
            self.data_order.num_items, config.max_steps, config.num_epochs, config.prompts_per_step
        )
        self.loss_fn = get_loss(config.loss_type)
        stop = answer_stops(env) if config.stop_at_answer_end else {}
        self.train_sampling = SamplingParams(
            config.max_new_tokens, config.temperature, config.top_p, config.top_k, stop
        )
        self.eval_sampling = SamplingParams(
            config.max_new_tokens, config.eval_temperature, config.top_p, config.top_k, stop
        )
        self.executor = ThreadPoolExecutor(max_workers=config.env_workers)
        self.output_dir = Path(config.output_dir)
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint written or read
        self.best_reward = -math.inf
        self.last_reward = math.nan
        self.last_eval_reward: float | None = None

    # --- setup ---------------------------------------------------------------------------
    def _load_policies(self, model_resolver: Callable[[str | None], str] | None) -> Policies:
        config = self.config
        if model_resolver is None:
            from magrpo.models import resolve_model as model_resolver
        names = config.models if config.models else [config.model] * len(self.agents)
        if len(names) != len(self.agents):
            raise ConfigError(
                f"--models lists {len(names)} model(s) but the env has {len(self.agents)} agents "
                f"({', '.join(self.agents)}): give one model per agent, in that order."
            )
        resolved: dict[str | None, str] = {}
        for name in names:
            if name not in resolved:
                resolved[name] = model_resolver(name)
        self.model_paths = [resolved[name] for name in names]
        return load_policies(
            self.agents,
            self.model_paths,
            finetune=config.finetune,
            lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_target_modules=config.lora_target_modules,
            dtype=config.dtype,
            use_chat_template=config.use_chat_template,
            need_reference=config.kl_coef > 0,
            device=self.accelerator.device,
            agent_devices=agent_devices(
                config.agent_devices, self.agents, self.parallel.world_size
            ),
            speedups=self.speedups,
        )

    def _sample_fn(self, params: SamplingParams) -> Callable:
        """The rollout's ``sample_fn``: transformers' generate, or vLLM when it serves."""
        sample = self.policies.sample if self.vllm is None else self.vllm.sample
        return lambda requests, n, seeds: sample(requests, n, params, seeds)

    # --- one step --------------------------------------------------------------------------
    def _reset_roots(self, env: Any, items: list[tuple[int | None, int]]):
        root_envs, root_observations = [], []
        for index, reset_seed in items:
            options = {"index": index} if index is not None else None
            observations, _ = env.reset(seed=reset_seed, options=options)
            root_envs.append(copy.deepcopy(env))
            root_observations.append(observations)
        return root_envs, root_observations

    def collect(self) -> RolloutResult:
        """Sample the rollout trees of this process's share of ``prompts_per_step`` episodes.

        Each tree's randomness is seeded by its episode's reset seed, so the samples of an
        episode are the same whatever the batch and the number of processes.
        """
        config = self.config
        self.speedups.rollout_started()
        items = [self.data_order.next() for _ in range(config.prompts_per_step)]
        items = self.parallel.shard(items)
        root_envs, root_observations = self._reset_roots(self.env, items)
        return run_rollout(
            root_envs,
            root_observations,
            self._sample_fn(self.train_sampling),
            self.executor,
            group_size=config.group_size,
            joint_mode=config.joint_mode,
            num_turns=config.num_turns,
            discount=config.discount,
            early_termination_threshold=config.early_termination_threshold,
            root_seeds=[reset_seed for _, reset_seed in items],
            record_state=self.algorithm.reads_state,
        )

    def build_samples(self, rollout: RolloutResult) -> tuple[list[TrainSample], dict[str, float]]:
        """Every completion with its advantage, as the algorithm computes them (MAGRPO: each
        node's samples of an agent form one group)."""
        return self.algorithm.advantages(rollout)

    def _micro_batches(
        self, samples: list[TrainSample]
    ) -> list[tuple[list[str], list[list[TrainSample]]]]:
        """Per model (every one, in a fixed order, even without samples): its agents and its
        micro-batches. Samples of one (agent, prompt) group stay adjacent, so a micro-batch
        runs each distinct prompt once (see Policies.logprobs)."""
        size = self.config.micro_batch_size
        models = []
        for key, loaded in enumerate(self.policies.models):
            ordered = sorted(
                (s for s in samples if self.policies.group_key(s.agent) == key),
                key=lambda s: (
                    len(s.completion.prompt_ids),
                    s.completion.prompt_ids,
                    s.agent,
                    len(s.completion.completion_ids),
                ),
            )
            batches = [ordered[i : i + size] for i in range(0, len(ordered), size)]
            models.append(([a for a in self.agents if a in loaded.agents], batches))
        return models

    def update(self, samples: list[TrainSample]) -> dict[str, float]:
        """Policy-gradient update(s) of every agent from one rollout."""
        config = self.config
        # global totals: the processes' losses then sum to the loss of the global batch
        totals = self._agent_totals(samples)
        normalizers = {
            agent: LossNormalizer(
                num_sequences=int(totals[agent].sequences),
                num_tokens=int(totals[agent].tokens),
                max_new_tokens=config.max_new_tokens,
            )
            for agent in self.agents
        }
        use_kl = config.kl_coef > 0
        # log-probs of the distribution the samples came from: softmax(logits / T)
        temperature = config.temperature if config.tempered_logprobs else 1.0
        # Without a KL term a zero advantage contributes exactly zero gradient: skip it.
        active = samples if use_kl else [s for s in samples if s.advantage != 0.0]
        models = self._micro_batches(active)
        metrics: dict[str, float] = defaultdict(float)
        old_logprobs: dict[tuple[int, int], torch.Tensor] = {}
        ref_logprobs: dict[tuple[int, int], torch.Tensor] = {}
        kl_sum = kl_tokens = 0.0
        for epoch in range(config.num_update_epochs):
            # model by model, each stepped as soon as its micro-batches are done: with separate
            # models only one model's gradients are alive at a time
            for m, (agents, batches) in enumerate(models):
                for b, batch in enumerate(batches):
                    key = (m, b)
                    self.speedups.before_pass()
                    current = self.policies.logprobs(
                        [s.completion for s in batch], temperature=temperature
                    )
                    if epoch == 0:
                        old_logprobs[key] = current.logprobs.detach()
                        if use_kl:
                            ref_logprobs[key] = self.policies.logprobs(
                                [s.completion for s in batch], reference=True,
                                temperature=temperature,
                            ).logprobs
                    advantages = torch.tensor(
                        [s.advantage for s in batch], device=current.logprobs.device
                    )
                    token_loss, kl = self.algorithm.token_loss(
                        current.logprobs, advantages, old_logprobs[key], ref_logprobs.get(key)
                    )
                    loss = torch.zeros((), device=token_loss.device)
                    for agent in sorted({s.agent for s in batch}):
                        rows = torch.tensor([i for i, s in enumerate(batch) if s.agent == agent])
                        agent_loss = self.loss_fn(
                            token_loss[rows], current.mask[rows], normalizers[agent]
                        )
                        loss = loss + agent_loss
                        if epoch == 0:
                            metrics[f"loss/{agent}"] += float(agent_loss.detach())
                    self.speedups.before_pass()
                    with self.speedups.backward(agents, last=b == len(batches) - 1):
                        self.accelerator.backward(loss)
                    if epoch == 0:
                        metrics["loss"] += float(loss.detach())
                        if kl is not None:
                            kl_sum += float((kl.detach() * current.mask).sum())
                            kl_tokens += float(current.mask.sum())
                for agent in agents:
                    norm = self._optimizer_step(agent)
                    if epoch == 0 and norm is not None:
                        metrics[f"grad_norm/{agent}"] = norm
            self.speedups.weights_changed()
        if self.vllm is not None:
            self.vllm.sync()  # vLLM samples the next rollout with the updated adapters
        # per-process partial sums -> global values (grad norms are already global)
        summed = ["loss", *(f"loss/{agent}" for agent in self.agents)]
        for key, value in zip(summed, self.parallel.sum([metrics[k] for k in summed]), strict=True):
            metrics[key] = value
        kl_sum, kl_tokens, trained = self.parallel.sum([kl_sum, kl_tokens, len(active)])
        if kl_tokens:
            metrics["kl"] = kl_sum / kl_tokens
        metrics["trained_sequences"] = trained
        return dict(metrics)

    def _optimizer_step(self, agent: str) -> float | None:
        """Sum the agent's gradients over processes, clip, step; returns the norm (if clipped)."""
        params = list(self.policies.named_trainable_parameters(agent).values())
        if not self.parallel.sum_gradients(params):
            return None
        norm = None
        if self.config.max_grad_norm is not None:
            norm = float(self.accelerator.clip_grad_norm_(params, self.config.max_grad_norm))
        self.optimizers[agent].step()
        self.optimizers[agent].zero_grad(set_to_none=True)
        return norm

    def train_step(self) -> dict[str, float]:
        started = time.perf_counter()
        rollout = self.collect()
        samples, sample_metrics = self.build_samples(rollout)
        update_started = time.perf_counter()
        update_metrics = self.update(samples)
        update_metrics.update(self.algorithm.update_extras(rollout))  # e.g. a critic
        update_seconds = time.perf_counter() - update_started
        everyone = self.parallel.gather_rollouts(rollout)
        metrics = {
            **rollout_metrics(everyone),
            **sample_metrics,
            **update_metrics,
            "tokens_per_second": everyone.generated_tokens / max(everyone.seconds_generate, 1e-9),
            "time/generate": everyone.seconds_generate,
            "time/env": everyone.seconds_env,
            "time/update": update_seconds,
            "time/step": time.perf_counter() - started,
            "epoch": self.data_order.epoch
            + self.data_order.position / (self.data_order.num_items or 1),
        }
        for agent, total in self._agent_totals(samples).items():
            metrics[f"completion_length/{agent}"] = total.tokens / max(total.sequences, 1)
            metrics[f"completion_finished_frac/{agent}"] = total.finished / max(total.sequences, 1)
            metrics[f"cut_off_frac/{agent}"] = 1.0 - metrics[f"completion_finished_frac/{agent}"]
        return metrics

    def _agent_totals(self, samples: list[TrainSample]) -> dict[str, AgentTotals]:
        """Per agent, over every process: completions, their tokens, how many ended with EOS."""
        local = [
            [
                sum(1 for s in samples if s.agent == agent),
                sum(len(s.completion.completion_ids) for s in samples if s.agent == agent),
                sum(s.completion.finished for s in samples if s.agent == agent),
            ]
            for agent in self.agents
        ]
        summed = iter(self.parallel.sum([value for row in local for value in row]))
        return {agent: AgentTotals(*(next(summed) for _ in range(3))) for agent in self.agents}

    # --- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Roll out ``eval_size`` items of the eval env with the eval sampling settings."""
        env = self.eval_env if self.eval_env is not None else self.env
        num_items = getattr(env, "num_items", None)
        count = (
            min(self.config.eval_size, num_items)
            if isinstance(num_items, int)
            else self.config.eval_size
        )
        items = [
            (i if isinstance(num_items, int) else None, self.config.seed + 10**6 + i)
            for i in range(count)
        ]
        items = self.parallel.shard(items)
        root_envs, root_observations = self._reset_roots(env, items)
        rollout = run_rollout(
            root_envs,
            root_observations,
            self._sample_fn(self.eval_sampling),
            self.executor,
            group_size=1,
            num_turns=self.config.num_turns,
            discount=self.config.discount,
            root_seeds=[reset_seed for _, reset_seed in items],
        )
        everyone = self.parallel.gather_rollouts(rollout)
        return {f"eval/{k}": v for k, v in rollout_metrics(everyone).items()}

    # --- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weights": {
                agent: {
                    n: p.detach().clone()
                    for n, p in self.policies.named_trainable_parameters(agent).items()
                }
                for agent in self.agents
            },
            "optimizers": {agent: opt.state_dict() for agent, opt in self.optimizers.items()},
            "algorithm": self.algorithm.state_dict(),
            "rng": rng_state(),
            "data_order": self.data_order.state_dict(),
            "best_reward": self.best_reward,
            "last_reward": self.last_reward,
            "last_eval_reward": self.last_eval_reward,
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for agent in self.agents:
                params = self.policies.named_trainable_parameters(agent)
                for name, value in state["weights"][agent].items():
                    params[name].copy_(value)
        for agent, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][agent])
        self.algorithm.load_state_dict(state.get("algorithm", {}))
        self.data_order.load_state_dict(state["data_order"])
        self.step = state["step"]
        self.best_reward = state["best_reward"]
        self.last_reward = state["last_reward"]
        self.last_eval_reward = state["last_eval_reward"]
        restore_rng_state(state["rng"])

    def save_checkpoint(self) -> Path:
        """Process 0 writes (the state is the same on every process); the others wait for it."""
        path = checkpoint_root(self.output_dir) / f"step-{self.step}"
        if self.parallel.is_main:
            path = save_checkpoint(
                self.output_dir, self.step, self.state_dict(), self.config.save_total_limit
            )
        self.parallel.barrier()
        self.saved_step = self.step
        return path

    def save_final(self) -> Path:
        folder = self.output_dir / (MODELS_DIR if self.config.finetune == "full" else ADAPTERS_DIR)
        if self.parallel.is_main:
            for agent in self.agents:
                self.policies.save_agent(agent, folder)
            self.algorithm.save(folder)
        self.parallel.barrier()
        return folder

    # --- the loop --------------------------------------------------------------------------
    def train(self) -> TrainResult:
        config = self.config
        resume_step = None
        if config.resume:
            checkpoint = latest_checkpoint(self.output_dir)
            if checkpoint is None:
                logger.warning("--resume: no checkpoint in %s, starting fresh", self.output_dir)
            else:
                self.load_state_dict(load_checkpoint(checkpoint))
                resume_step = self.saved_step = self.step
                if self.vllm is not None:
                    self.vllm.sync()
                logger.info("resumed from %s (step %d)", checkpoint, self.step)
        if self.parallel.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
            metrics_logger = MetricsLogger(
                self.output_dir,
                config.log_backends,
                config.to_dict(),
                config.wandb_project,
                resume_step,
            )
        else:  # every process computes the same metrics; one writes them
            metrics_logger = NullMetricsLogger(self.output_dir)
        history: list[dict[str, Any]] = []
        progress = progress_bar(
            config.progress_bar and self.parallel.is_main, self.total_steps, self.step
        )
        started = time.perf_counter()
        budget = None if config.max_train_minutes is None else 60 * config.max_train_minutes

        def out_of_time() -> bool:  # every process stops at the same step
            return budget is not None and self.parallel.any(time.perf_counter() - started > budget)

        try:
            if config.eval_interval and resume_step is None and self.step == 0:
                baseline = self.evaluate()  # step 0: the untrained agents, for before/after
                self.last_eval_reward = baseline["eval/reward/mean"]
                metrics_logger.log(baseline, 0)
                history.append(baseline)
            while self.step < self.total_steps and not out_of_time():
                metrics = self.train_step()
                self.step += 1
                self.last_reward = metrics["reward/mean"]
                self.best_reward = max(self.best_reward, self.last_reward)
                eval_due = config.eval_interval and (
                    self.step % config.eval_interval == 0 or self.step == self.total_steps
                )
                if eval_due:
                    eval_started = time.perf_counter()
                    metrics.update(self.evaluate())
                    metrics["time/eval"] = time.perf_counter() - eval_started
                    self.last_eval_reward = metrics["eval/reward/mean"]
                metrics_logger.log(metrics, self.step)
                history.append(metrics)
                if config.save_interval and self.step % config.save_interval == 0:
                    self.save_checkpoint()
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(
                        reward=f"{self.last_reward:.3f}", s_step=f"{metrics['time/step']:.1f}"
                    )
            if self.saved_step != self.step:
                self.save_checkpoint()
            adapters_dir = self.save_final()
        finally:
            if progress is not None:
                progress.close()
            metrics_logger.close()
        return TrainResult(
            self.output_dir,
            self.step,
            self.last_reward,
            self.best_reward,
            self.last_eval_reward,
            adapters_dir,
            metrics_logger.path,
            history,
        )

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.vllm is not None:
            self.vllm.close()


def _adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float):
    """AdamW, fused where torch has the kernel: one pass over each tensor, no model-sized
    temporaries. Measured on SmolLM2-135M fully fine-tuned, CPU, one thread: the default
    multi-tensor version peaks 0.53 GB above the steady state and takes 0.66 s per step;
    the fused one adds nothing and takes 0.16 s."""
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
