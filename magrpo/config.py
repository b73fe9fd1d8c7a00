"""MAGRPOConfig: every knob of a training run, with help text, YAML loading and CLI flags.

A config is built from (lowest to highest priority) the dataclass defaults (a CPU run that
finishes in minutes), a YAML file (``--config configs/paper/tldr.yaml``) and command-line
flags (``--group-size 4 --max-new-tokens 128``: every field is a kebab-case flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from magrpo.cli import add_dataclass_arguments, flag_help, split_commas
from magrpo.speedups import SPEEDUP_MODES

JOINT_MODES = ("aligned", "cross")
#: Advantage estimators whose baseline comes from the group: meaningless with group_size 1.
GROUP_BASELINES = ("magrpo", "rloo", "remax")
FINETUNE_MODES = ("lora", "full")
DTYPES = ("float32", "bfloat16", "float16")
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")
GENERATION_BACKENDS = ("hf", "vllm")
CPU_HEAP_POLICIES = ("auto", "keep", "release")

#: The memory options of ``magrpo.speedups`` (they need ``speedups="auto"``).
MEMORY_OPTIONS = ("gradient_checkpointing", "reuse_sampled_states", "optimizer_in_backward")


def is_positive_int(value: Any) -> bool:
    """A count such as a group size or a token limit: an int of at least 1 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class ConfigError(ValueError):
    """A configuration value a user can fix; the message says what and how."""


@dataclass
class MAGRPOConfig:
    """All settings of a MAGRPO run. Defaults: a short CPU run with SmolLM2-135M + LoRA."""

    # Environment ---------------------------------------------------------------------------
    env: str = field(
        default="coophumaneval-v2",
        metadata=flag_help(
            "Environment id for llm_marl_envs.make (a name without -vN: the newest version)."
        ),
    )
    env_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=flag_help(
            "Extra keyword arguments for the env, as JSON, e.g. '{\"max_turns\": 2}'."
        ),
    )
    data: str | None = field(
        default=None,
        metadata=flag_help(
            "Dataset for the env: a local file/folder or a Hugging Face dataset id."
        ),
    )
    train_split: str | None = field(
        default=None, metadata=flag_help("Dataset split for training (None: the env's default).")
    )
    eval_split: str | None = field(
        default=None, metadata=flag_help("Dataset split for evaluation (None: the env's default).")
    )

    # Models --------------------------------------------------------------------------------
    model: str | None = field(
        default=None,
        metadata=flag_help(
            "Model for every agent: local folder or Hugging Face id (None: SmolLM2-135M-Instruct)."
        ),
    )
    models: list[str] | None = field(
        default=None,
        metadata=flag_help(
            "One model per agent, in the env's possible_agents order (separate models: "
            "heterogeneous agents). Overrides --model."
        ),
    )
    finetune: str = field(
        default="lora",
        metadata=flag_help(
            "'lora': one frozen base shared by all agents, one LoRA adapter per agent; "
            "'full': a separate fully fine-tuned model per agent."
        ),
    )
    lora_rank: int = field(default=8, metadata=flag_help("LoRA rank r."))
    lora_alpha: float = field(default=16.0, metadata=flag_help("LoRA alpha (scaling = alpha / r)."))
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "v_proj"],
        metadata=flag_help("Modules that get LoRA adapters, or ['all-linear']."),
    )
    dtype: str = field(
        default="float32", metadata=flag_help("Model weight dtype: float32 | bfloat16 | float16.")
    )
    agent_devices: list[str] | None = field(
        default=None,
        metadata=flag_help(
            "One torch device per agent, in possible_agents order (e.g. cuda:0 cuda:1), for "
            "separate models (--finetune full or --models): agent i lives on device i. None: "
            "every model on the process's device."
        ),
    )
    use_chat_template: bool = field(
        default=True,
        metadata=flag_help(
            "Wrap each observation in the tokenizer's chat template (off: raw text prompts, "
            "as the paper does with base models)."
        ),
    )

    # Algorithm -----------------------------------------------------------------------------
    algorithm: str = field(
        default="magrpo",
        metadata=flag_help(
            "What a step computes from its rollout, by name: magrpo (group-relative "
            "advantages, the paper's) | iac (a critic per agent) | maac (one centralised "
            "critic that reads the env's state()) | a registered one (magrpo.register_algorithm)."
        ),
    )
    group_size: int = field(
        default=4, metadata=flag_help("G: completions sampled per agent per node.")
    )
    joint_mode: str = field(
        default="cross",
        metadata=flag_help(
            "'cross' (default): the Cartesian product of the agents' samples (G^N joints), each "
            "sample credited with the mean over its joints, so one agent's signal is not "
            "drowned by the others' sampling noise; 'aligned' (the paper's): sample g of every "
            "agent forms joint action g (G joints)."
        ),
    )
    num_turns: int = field(
        default=1, metadata=flag_help("Horizon H of the rollout tree (turns per episode).")
    )
    discount: float = field(
        default=0.9, metadata=flag_help("gamma: R_j = r_j + gamma * mean(child node returns).")
    )
    early_termination_threshold: float | None = field(
        default=None,
        metadata=flag_help("A node whose mean joint reward exceeds this is not expanded further."),
    )
    advantage: str = field(
        default="magrpo",
        metadata=flag_help(
            "Advantage estimator by name: magrpo | rloo | remax | reinforce | custom."
        ),
    )
    normalize_advantage_std: bool = field(
        default=False, metadata=flag_help("Divide each group's advantages by (std + 1e-6).")
    )
    loss_type: str = field(
        default="sequence_sum",
        metadata=flag_help(
            "Loss reduction by name: sequence_sum (paper) | token_mean | sequence_mean | dr_grpo."
        ),
    )
    clip_epsilon: float | None = field(
        default=None,
        metadata=flag_help("PPO-style ratio clipping epsilon (None: plain policy gradient)."),
    )
    num_update_epochs: int = field(
        default=1, metadata=flag_help("Optimizer steps per rollout (>1 needs importance ratios).")
    )
    kl_coef: float = field(
        default=0.0,
        metadata=flag_help(
            "Weight of the KL penalty to the reference policy (with LoRA: the base model, "
            "adapters disabled; k3 estimator)."
        ),
    )

    # Critics ---------------------------------------------------------------------------------
    critic_learning_rate: float = field(
        default=1e-3, metadata=flag_help("AdamW learning rate of the critics (iac, maac).")
    )
    critic_steps: int = field(
        default=4,
        metadata=flag_help("Critic optimizer steps on each rollout's value targets (iac, maac)."),
    )
    critic_hidden_size: int = field(
        default=256, metadata=flag_help("Width of the critics' value-head MLP (iac, maac).")
    )
    gae_lambda: float = field(
        default=1.0,
        metadata=flag_help(
            "lambda of GAE across turns (iac, maac): 1 gives A = R - V(s), the Monte Carlo "
            "return minus the critic's value; lower values lean on the critic's bootstrap."
        ),
    )

    # Sampling ------------------------------------------------------------------------------
    temperature: float = field(default=0.8, metadata=flag_help("Sampling temperature (training)."))
    tempered_logprobs: bool = field(
        default=True,
        metadata=flag_help(
            "Compute the policy's, the old and the reference log-probs at the sampling "
            "temperature, log softmax(logits / T): the distribution the samples came from, "
            "as TRL does. Off: at temperature 1, as the authors' library does."
        ),
    )
    top_p: float = field(default=0.95, metadata=flag_help("Nucleus sampling top_p (1.0: off)."))
    top_k: int = field(default=0, metadata=flag_help("Top-k sampling (0: off)."))
    max_new_tokens: int | None = field(
        default=None,
        metadata=flag_help(
            "Max tokens per completion (answers usually end earlier, at EOS or at the env's "
            "stop strings). Default: the env's answer budget (metadata['answer_format']): 384 "
            "for the coding envs, where 91% of the untrained default model's answers finish "
            "(86.5% at the paper's 256), and 256 for the writing envs, whose rewards cap an "
            "answer at 256 words (docs/training.md)."
        ),
    )
    stop_at_answer_end: bool = field(
        default=True,
        metadata=flag_help(
            "End each answer where the env says it is complete (its metadata['answer_format'] "
            "stop strings, e.g. the closing code fence); the stopped text is what is trained."
        ),
    )
    eval_temperature: float = field(
        default=0.0, metadata=flag_help("Sampling temperature in evaluation (0: greedy).")
    )

    # Optimisation --------------------------------------------------------------------------
    learning_rate: float = field(default=1e-4, metadata=flag_help("AdamW learning rate."))
    weight_decay: float = field(default=0.0, metadata=flag_help("AdamW weight decay."))
    max_grad_norm: float | None = field(
        default=1.0,
        metadata=flag_help("Clip each agent's gradient norm to this (None: no clipping)."),
    )
    max_steps: int | None = field(
        default=20, metadata=flag_help("Number of training steps (None: use num_epochs).")
    )
    num_epochs: float | None = field(
        default=None,
        metadata=flag_help(
            "Passes over the dataset (needs an env with num_items); stops first wins."
        ),
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata=flag_help(
            "A wall-clock budget: stop after the step that ends past this many minutes of "
            "this process's training (evaluation included), e.g. to compare algorithms at "
            "equal time. None: no budget."
        ),
    )
    prompts_per_step: int = field(
        default=1, metadata=flag_help("Dataset items (episode roots) per training step.")
    )
    micro_batch_size: int = field(
        default=4,
        metadata=flag_help(
            "Completions per forward/backward pass; memory grows with it. A multiple of "
            "group_size runs each group's shared prompt once."
        ),
    )
    seed: int = field(
        default=0, metadata=flag_help("Random seed (torch, numpy, python, data order).")
    )
    generation_backend: str = field(
        default="hf",
        metadata=flag_help(
            "Who samples completions: 'hf' (transformers generate) | 'vllm' (one base + one "
            "LoRA per agent served by vLLM; needs a CUDA GPU and the vllm extra)."
        ),
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.5,
        metadata=flag_help("Fraction of GPU memory vLLM may take (the trainer needs the rest)."),
    )

    # Output, evaluation, logging -----------------------------------------------------------
    output_dir: str = field(
        default="runs/magrpo", metadata=flag_help("Where everything is written.")
    )
    save_interval: int = field(
        default=10, metadata=flag_help("Write a checkpoint every N steps (0: only the final one).")
    )
    save_total_limit: int = field(
        default=2, metadata=flag_help("Checkpoints kept (oldest deleted).")
    )
    resume: bool = field(
        default=False, metadata=flag_help("Continue from the latest checkpoint in output_dir.")
    )
    eval_interval: int = field(
        default=10, metadata=flag_help("Evaluate every N steps and at the end (0: never).")
    )
    eval_size: int = field(default=4, metadata=flag_help("Items evaluated per evaluation."))
    log_backends: list[str] = field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        metadata=flag_help(
            "Metric sinks: jsonl (always on) | tensorboard (used when installed) | wandb."
        ),
    )
    wandb_project: str = field(
        default="magrpo", metadata=flag_help("W&B project (only with --log-backends wandb).")
    )
    env_workers: int = field(
        default=8, metadata=flag_help("Threads stepping branched env copies concurrently.")
    )
    progress_bar: bool = field(default=True, metadata=flag_help("Show a tqdm progress bar."))

    # Speed and memory ----------------------------------------------------------------------
    speedups: str = field(
        default="auto",
        metadata=flag_help(
            "'auto': every speed-up of magrpo.speedups where it applies (fused CPU decode "
            "step, oneDNN products, chunked output layer, ...; same results up to float "
            "rounding); 'off': plain transformers + peft + torch. The memory options below "
            "need 'auto'."
        ),
    )
    torch_threads: int | None = field(
        default=None, metadata=flag_help("torch.set_num_threads (None: torch's default).")
    )
    cpu_heap: str = field(
        default="auto",
        metadata=flag_help(
            "CPU training: 'keep' freed memory for the next step (no page faults on its "
            "gradients and packed weights; higher resident memory), 'release' it to the OS "
            "between phases, 'auto': keep for --finetune full (release with "
            "--gradient-checkpointing, --reuse-sampled-states or --optimizer-in-backward), "
            "release for LoRA."
        ),
    )
    sample_side_by_side: bool = field(
        default=True,
        metadata=flag_help(
            "CPU, one model per agent (--finetune full or --models): the models decode at "
            "the same time, each on its share of the threads (faster; every model's packed "
            "decode weights are held at once instead of one model's)."
        ),
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=flag_help(
            "Keep only each decoder layer's input for backward and run the layer again there: "
            "much less memory in the update, for one more forward of the model. Every memory "
            "option also lets sampling's packed decode weights take the weights' memory."
        ),
    )
    reuse_sampled_states: bool = field(
        default=False,
        metadata=flag_help(
            "Start the update from every decoder layer's input as sampling computed it and "
            "run its backward one layer at a time from the top: the memory of "
            "--gradient-checkpointing without its second forward. Gradients equal the "
            "ordinary pass's up to float rounding. Llama/Qwen2 models sampled on CPU, first "
            "update epoch; elsewhere the ordinary pass runs."
        ),
    )
    optimizer_in_backward: bool = field(
        default=False,
        metadata=flag_help(
            "Step each weight inside the backward, as soon as its gradient is complete, and "
            "free that gradient: no model-sized gradient buffer (the log-prob pass then runs "
            "prompts and completions through the layers in turn). Needs max_grad_norm None "
            "and one process; saves memory when a model's samples fit one micro-batch."
        ),
    )

    # ---------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError with one clear paragraph for the first bad value found."""

        def bad(name: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(
                f"Invalid configuration: {name}={value!r}. Expected {expected}. Fix it in the "
                f"YAML file or with --{name.replace('_', '-')} on the command line."
            )

        positive = (
            "group_size",
            "num_turns",
            "prompts_per_step",
            "micro_batch_size",
            "num_update_epochs",
            "lora_rank",
            "critic_steps",
            "critic_hidden_size",
            "env_workers",
        )

        for name in positive:
            if not is_positive_int(getattr(self, name)):
                raise bad(name, getattr(self, name), "a positive integer")
        if self.max_new_tokens is not None and not is_positive_int(self.max_new_tokens):
            raise bad(
                "max_new_tokens", self.max_new_tokens, "a positive integer, or null (the env's)"
            )
        for name in ("save_interval", "eval_interval", "eval_size", "save_total_limit", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise bad(name, value, "a non-negative integer")
        if self.eval_interval and not self.eval_size:
            raise bad("eval_size", self.eval_size, "at least 1 when eval_interval > 0")
        choices = {
            "joint_mode": JOINT_MODES,
            "finetune": FINETUNE_MODES,
            "dtype": DTYPES,
            "generation_backend": GENERATION_BACKENDS,
            "cpu_heap": CPU_HEAP_POLICIES,
            "speedups": SPEEDUP_MODES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise bad(name, value, f"one of {', '.join(allowed)}")
        if not 0.0 <= self.discount <= 1.0:
            raise bad("discount", self.discount, "a number in [0, 1]")
        if not 0.0 <= self.gae_lambda <= 1.0:
            raise bad("gae_lambda", self.gae_lambda, "a number in [0, 1]")
        if self.critic_learning_rate <= 0:
            raise bad("critic_learning_rate", self.critic_learning_rate, "a positive number")
        if self.temperature <= 0:
            raise bad("temperature", self.temperature, "a positive number (training samples)")
        if self.eval_temperature < 0:
            raise bad("eval_temperature", self.eval_temperature, "0 (greedy) or more")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if self.learning_rate <= 0:
            raise bad("learning_rate", self.learning_rate, "a positive number")
        if self.kl_coef < 0:
            raise bad("kl_coef", self.kl_coef, "0 or more")
        if self.clip_epsilon is not None and self.clip_epsilon <= 0:
            raise bad("clip_epsilon", self.clip_epsilon, "a positive number or None")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise bad("max_grad_norm", self.max_grad_norm, "a positive number or None")
        if self.optimizer_in_backward and self.max_grad_norm is not None:
            raise ConfigError(
                f"optimizer_in_backward steps each weight before the other weights' gradients "
                f"exist, so their norm cannot be clipped to max_grad_norm={self.max_grad_norm}: "
                "set max_grad_norm to None (--max-grad-norm none) or turn "
                "optimizer_in_backward off."
            )
        if self.speedups == "off":
            asked = [f"--{n.replace('_', '-')}" for n in MEMORY_OPTIONS if getattr(self, n)]
            asked += ["--cpu-heap keep"] if self.cpu_heap == "keep" else []
            if asked:
                raise ConfigError(
                    f"{', '.join(asked)} are memory options of magrpo.speedups, but --speedups "
                    "is off (plain transformers + peft + torch): use --speedups auto, or drop them."
                )
        if self.max_steps is None and self.num_epochs is None:
            raise bad("max_steps", None, "a step count, or set num_epochs")
        if self.max_steps is not None and self.max_steps < 1:
            raise bad("max_steps", self.max_steps, "a positive integer")
        if self.max_train_minutes is not None and self.max_train_minutes <= 0:
            raise bad("max_train_minutes", self.max_train_minutes, "a positive number or None")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise bad("num_epochs", self.num_epochs, "a positive number")
        if self.num_update_epochs > 1 and self.clip_epsilon is None:
            raise ConfigError(
                f"Invalid configuration: num_update_epochs={self.num_update_epochs} reuses each "
                "rollout for several optimizer steps, which is off-policy after the first one "
                "and needs clipped importance ratios. Set --clip-epsilon (e.g. 0.2) or use "
                "--num-update-epochs 1."
            )
        if not 0.0 < self.vllm_gpu_memory_utilization < 1.0:
            raise bad(
                "vllm_gpu_memory_utilization",
                self.vllm_gpu_memory_utilization,
                "a number in (0, 1)",
            )
        if self.agent_devices is not None and len(self.agent_devices) == 0:
            raise bad("agent_devices", self.agent_devices, "a non-empty list, one device per agent")
        if self.models is not None and len(self.models) == 0:
            raise bad("models", self.models, "a non-empty list, one model per agent")
        unknown = [b for b in self.log_backends if b not in LOG_BACKENDS]
        if unknown:
            raise bad("log_backends", self.log_backends, f"a list from {', '.join(LOG_BACKENDS)}")
        if not isinstance(self.env_kwargs, dict):
            raise bad("env_kwargs", self.env_kwargs, "a JSON object / mapping")
        # Registries are checked here too, so a typo fails before any model is loaded.
        from magrpo.advantages import available_advantages
        from magrpo.algorithms import available_algorithms, get_algorithm
        from magrpo.losses import available_losses

        if self.algorithm not in available_algorithms():
            raise bad("algorithm", self.algorithm, f"one of {', '.join(available_algorithms())}")
        if self.loss_type not in available_losses():
            raise bad("loss_type", self.loss_type, f"one of {', '.join(available_losses())}")
        if self.advantage not in available_advantages():
            raise bad("advantage", self.advantage, f"one of {', '.join(available_advantages())}")
        group_baseline = get_algorithm(self.algorithm).uses_advantage_setting
        if not group_baseline and (self.advantage != "magrpo" or self.normalize_advantage_std):
            raise ConfigError(
                f"--advantage and --normalize-advantage-std choose the group baseline of "
                f"--algorithm magrpo; --algorithm {self.algorithm} computes its advantages "
                "itself: drop them, or use --algorithm magrpo."
            )
        if group_baseline and self.group_size == 1 and self.advantage in GROUP_BASELINES:
            raise bad(
                "group_size",
                self.group_size,
                f"at least 2 with advantage={self.advantage!r}: its baseline is computed from the "
                "group, so a group of one has advantage 0 and nothing is learnt (or choose "
                "advantage='reinforce', which needs no group)",
            )
        if group_baseline and self.group_size == 1:
            warnings.warn(
                f"group_size=1 with advantage={self.advantage!r}: each sample's advantage is "
                "computed from its own return alone, with no group baseline.",
                stacklevel=2,
            )

    # ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> MAGRPOConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MAGRPOConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        normalised = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(normalised) - names)
        if unknown:
            raise ConfigError(
                f"Unknown configuration key(s): {', '.join(unknown)}. Known keys: "
                f"{', '.join(sorted(names))}."
            )
        return cls(**normalised)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> MAGRPOConfig:
        return cls.from_dict({**load_yaml(path), **overrides})


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"Cannot read config file {path}: {error}.") from error
    values = yaml.safe_load(text) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of field: value.")
    return values


# --- command line ----------------------------------------------------------------------------


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m magrpo.train",
        description="Train LLM agents with MAGRPO on a PettingZoo text environment.",
    )
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="YAML file of config values (flags override it).",
    )
    add_dataclass_arguments(parser, MAGRPOConfig)
    return parser


def config_from_args(argv: list[str] | None = None) -> MAGRPOConfig:
    """Parse CLI flags (and an optional --config YAML file) into a validated config."""
    parsed = vars(build_arg_parser().parse_args(argv))
    config_path = parsed.pop("config", None)
    values = load_yaml(config_path) if config_path else {}
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    values.update(split_commas(parsed))
    return MAGRPOConfig.from_dict(values)
