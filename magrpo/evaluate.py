"""``python -m magrpo.evaluate``: the paper's baselines and metrics on any env of the suite.

    python -m magrpo.evaluate --env coophumaneval --data coophumaneval.json \\
        --protocols parallel sequential trained --adapters runs/x --samples 15 --k 1 3 5 10

runs each protocol (``magrpo.protocols``) on the evaluation split (default: the paper's,
``llm_marl_envs.default_eval_split``), lets the env score every joint action, aggregates the
env's reward parts and infos into the task's metrics (``magrpo.metrics``), prints a markdown
table on stdout and writes ``results.json``, ``results.md``, ``samples.jsonl`` (every joint
action and its score) and PNG bar charts (``magrpo.plot``) to ``--output-dir``. User mistakes
(unknown protocol, missing adapters folder, k > samples, ...) end with one paragraph on stderr
and exit code 2.

Models: ``--model`` for every agent (default: the trained run's base model, else
SmolLM2-135M-Instruct), ``--models a b`` one per agent, ``--single-model`` for the
``single`` protocol (default: ``--model``). ``trained`` loads ``--adapters``: a run folder of
``magrpo.train`` (its ``adapters/<agent>`` peft folders, or ``models/<agent>`` after full
fine-tuning, else its latest checkpoint), an ``adapters`` folder, or one checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from magrpo.cli import add_dataclass_arguments, flag_help, split_commas
from magrpo.metrics import compute_metrics, task_family
from magrpo.protocols import PROTOCOLS, Actor, Generator, ProtocolStats, run_protocol

logger = logging.getLogger("magrpo.evaluate")

DEFAULT_BASELINES = ("single", "parallel", "sequential", "discussion")


class EvaluationError(ValueError):
    """A mistake in the evaluation's arguments or inputs; the message says how to fix it."""


@dataclass
class EvalSettings:
    """Every setting of an evaluation; ``python -m magrpo.evaluate`` builds its flags from
    these fields (``magrpo.cli``), grouped by the section comments below."""

    # Environment ---------------------------------------------------------------------------
    env: str = field(metadata=flag_help("Env id (tldr, arxiv, humaneval, coophumaneval)."))
    data: str | None = field(
        default=None, metadata=flag_help("Local data file/folder or Hugging Face dataset id.")
    )
    split: str | None = field(
        default=None,
        metadata=flag_help("Split (default: the paper's evaluation split of the env)."),
    )
    limit: int | None = field(
        default=None, metadata=flag_help("Evaluate only the first N problems of the split.")
    )
    turns: int = field(default=1, metadata=flag_help("Turns per episode (env max_turns)."))

    # Protocols and models ------------------------------------------------------------------
    protocols: list[str] | None = field(
        default=None,
        metadata=flag_help(
            f"From: {', '.join(PROTOCOLS)} (default: {' '.join(DEFAULT_BASELINES)}, and "
            "trained with --adapters)."
        ),
    )
    adapters: str | None = field(
        default=None, metadata=flag_help("Output folder of magrpo.train (or its adapters folder).")
    )
    model: str | None = field(
        default=None, metadata=flag_help("Model of every agent (default: the run's, else SmolLM2).")
    )
    models: list[str] | None = field(
        default=None, metadata=flag_help("One model per agent, in agent order.")
    )
    single_model: str | None = field(
        default=None, metadata=flag_help("Model of the single protocol (default: --model).")
    )
    dtype: str = field(default="float32", metadata=flag_help("float32 | bfloat16 | float16."))
    chat_template: bool | None = field(
        default=None,
        metadata=flag_help(
            "Wrap prompts in the chat template (default: as the run was trained, else on)."
        ),
    )

    # Sampling and metrics ------------------------------------------------------------------
    samples: int = field(default=15, metadata=flag_help("Samples per problem (n)."))
    k: list[int] | None = field(
        default=None, metadata=flag_help("k values of pass@k (default: 1 3 5 10, up to n).")
    )
    max_new_tokens: int = field(default=256, metadata=flag_help("Tokens per agent answer."))
    temperature: float = field(default=0.8, metadata=flag_help("Sampling temperature (0: greedy)."))
    top_p: float = field(default=0.95, metadata=flag_help("Nucleus sampling mass."))
    seed: int = field(default=0, metadata=flag_help("Random seed."))

    # Speed -----------------------------------------------------------------------------------
    max_batch: int = field(default=64, metadata=flag_help("Max rows per generate call."))
    per_agent_timing: bool = field(
        default=False,
        metadata=flag_help(
            "One generate call per agent per phase: measure each agent's time directly."
        ),
    )
    workers: int = field(default=8, metadata=flag_help("Threads scoring env copies."))
    torch_threads: int | None = field(
        default=None, metadata=flag_help("torch.set_num_threads (None: torch's default).")
    )

    # Output ------------------------------------------------------------------------------------
    output_dir: str | None = field(default=None, metadata=flag_help("Default: runs/eval/<env id>."))
    progress: bool = field(default=True, metadata=flag_help("Show a progress bar."))
    save_samples: bool = field(default=True, metadata=flag_help("Write samples.jsonl."))

    def ks(self) -> list[int]:
        return list(self.k) if self.k else [k for k in (1, 3, 5, 10) if k <= self.samples]


# --- argument checks -------------------------------------------------------------------------


def parse_protocols(values: list[str]) -> list[str]:
    names = [name.strip() for name in values if name.strip()]
    unknown = [name for name in names if name not in PROTOCOLS]
    if unknown or not names:
        raise EvaluationError(
            f"Unknown protocol(s) {unknown or values} in --protocols {' '.join(values)}. "
            f"Choose from: {', '.join(PROTOCOLS)} (e.g. --protocols parallel sequential "
            "trained)."
        )
    return list(dict.fromkeys(names))


def parse_ks(values: list[str]) -> list[int]:
    try:
        ks = sorted({int(part) for part in values if str(part).strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise EvaluationError(
            f"--k {' '.join(map(str, values))} must be positive integers, e.g. --k 1 3 5 10."
        )
    return ks


def check_settings(settings: EvalSettings) -> None:
    if settings.samples < 1:
        raise EvaluationError(f"--samples must be at least 1, got {settings.samples}.")
    too_big = [k for k in settings.ks() if k > settings.samples]
    if too_big:
        raise EvaluationError(
            f"--k asks for k={too_big} but only --samples {settings.samples} are drawn per "
            f"problem: pass@k needs k <= samples. Raise --samples to at least {max(too_big)} or "
            "drop those k values."
        )
    if "trained" in settings.protocols and not settings.adapters:
        raise EvaluationError(
            "The 'trained' protocol needs --adapters: the output folder of `python -m "
            "magrpo.train` (it holds adapters/<agent>), its adapters folder, or a checkpoint "
            "folder. Add --adapters runs/NAME, or drop 'trained' from --protocols."
        )
    for name in ("turns", "max_new_tokens", "max_batch", "workers"):
        if getattr(settings, name) < 1:
            raise EvaluationError(f"--{name.replace('_', '-')} must be at least 1.")
    if settings.limit is not None and settings.limit < 1:
        raise EvaluationError("--limit must be at least 1 (or left out: every problem).")
    if settings.temperature < 0 or not 0 < settings.top_p <= 1:
        raise EvaluationError("--temperature must be >= 0 (0: greedy) and --top-p in (0, 1].")


# --- trained agents ----------------------------------------------------------------------------


@dataclass
class TrainedSource:
    kind: str  # "peft" | "full" | "checkpoint"
    folders: dict[str, Path]  # per agent (peft, full) or {"*": checkpoint folder}
    run_config: dict[str, Any]


def find_trained(path: str, agents: list[str]) -> TrainedSource:
    """Locate what ``magrpo.train`` saved under ``path`` (see the module docstring)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise EvaluationError(
            f"--adapters {path}: no such folder. Pass the output folder of `python -m "
            "magrpo.train` (its --output-dir, e.g. runs/cpu), which holds adapters/<agent>."
        )
    run_config: dict[str, Any] = {}
    for candidate in (root, root.parent, root.parent.parent):
        if (candidate / "config.json").is_file():
            run_config = json.loads((candidate / "config.json").read_text())
            if "finetune" in run_config:
                break
            run_config = {}

    def per_agent(folder: Path, marker: str) -> dict[str, Path] | None:
        found = {a: folder / a for a in agents if (folder / a / marker).is_file()}
        return found if len(found) == len(agents) else None

    from magrpo.checkpoint import ADAPTERS_DIR, MODELS_DIR, STATE_FILE, latest_checkpoint

    for folder in (root / ADAPTERS_DIR, root):
        if (found := per_agent(folder, "adapter_config.json")) is not None:
            return TrainedSource("peft", found, run_config)
    for folder in (root / MODELS_DIR, root):
        if (found := per_agent(folder, "config.json")) is not None:
            return TrainedSource("full", found, run_config)

    checkpoint = root if (root / STATE_FILE).is_file() else latest_checkpoint(root)
    if checkpoint is not None:
        return TrainedSource("checkpoint", {"*": checkpoint}, run_config)
    listing = sorted(p.name for p in root.iterdir())[:12]
    raise EvaluationError(
        f"--adapters {path} holds no trained agents for {agents}: expected adapters/<agent>/"
        f"adapter_config.json (LoRA), models/<agent>/config.json (full fine-tuning) or "
        f"checkpoints/step-N/state.pt, as written by `python -m magrpo.train`; found {listing}."
    )


def _base_model(settings: EvalSettings, run_config: dict[str, Any], adapter: Path | None) -> str:
    from magrpo.models import resolve_model

    if settings.model is not None:
        return resolve_model(settings.model)
    if run_config.get("model") is not None or adapter is None:
        return resolve_model(run_config.get("model"))
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return resolve_model(base if base and Path(base).is_dir() else None)


def load_trained(settings: EvalSettings, agents: list[str]):
    """The trained policies, one per agent, exactly as ``magrpo.train`` saved them."""
    from peft.utils import load_peft_weights

    from magrpo.loading import load_policies

    source = find_trained(settings.adapters, agents)
    config = source.run_config
    chat = settings.chat_template
    use_chat = config.get("use_chat_template", True) if chat is None else chat
    dtype = settings.dtype
    if source.kind == "full":
        return load_policies(
            agents,
            [str(source.folders[a]) for a in agents],
            finetune="full",
            dtype=dtype,
            use_chat_template=use_chat,
        )
    if source.kind == "checkpoint":
        from magrpo.checkpoint import load_checkpoint

        state = load_checkpoint(source.folders["*"])
        config = state.get("config") or config
        weights = state["weights"]
        names = config.get("models") or [config.get("model")] * len(agents)
        from magrpo.models import resolve_model

        paths = [resolve_model(settings.model or name) for name in names]
        policies = load_policies(
            agents,
            paths,
            finetune=config.get("finetune", "lora"),
            lora_rank=config.get("lora_rank", 8),
            lora_alpha=config.get("lora_alpha", 16.0),
            lora_target_modules=config.get("lora_target_modules", ["q_proj", "v_proj"]),
            dtype=dtype,
            use_chat_template=use_chat,
        )
        for agent in agents:
            _copy_weights(policies.named_trainable_parameters(agent), weights[agent], agent)
        return policies
    adapter_configs = {
        a: json.loads((source.folders[a] / "adapter_config.json").read_text()) for a in agents
    }
    first = adapter_configs[agents[0]]
    if config.get("models"):
        paths = [_base_model(settings, {"model": m}, None) for m in config["models"]]
    else:
        paths = [_base_model(settings, config, source.folders[agents[0]])] * len(agents)
    targets = first["target_modules"]
    policies = load_policies(
        agents,
        paths,
        finetune="lora",
        lora_rank=first["r"],
        lora_alpha=first["lora_alpha"],
        lora_target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        dtype=dtype,
        use_chat_template=use_chat,
    )
    for agent in agents:
        adapter = policies.model_of[agent].adapter[agent]
        saved = load_peft_weights(str(source.folders[agent]), device="cpu")
        params = policies.named_trainable_parameters(agent)
        renamed = {
            re.sub(rf"\.{re.escape(adapter)}\.(?=[^.]+$)", ".", name): name for name in params
        }
        _copy_weights(params, {renamed.get(k, k): v for k, v in saved.items()}, agent)
    return policies


def _copy_weights(params: dict, values: dict, agent: str) -> None:
    import torch

    missing = sorted(set(params) - set(values))
    unexpected = sorted(set(values) - set(params))
    if missing or unexpected:
        raise EvaluationError(
            f"The trained weights of agent {agent!r} do not fit the model they are loaded "
            f"into: {len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:2]}). Evaluate with the base model the run was trained from "
            "(--model) and the same LoRA settings."
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name].to(param.dtype))


# --- untrained models --------------------------------------------------------------------------


class ModelPool:
    """Untrained models, each loaded once and shared by every role that uses it."""

    def __init__(self, dtype: str, use_chat_template: bool):
        self.dtype = dtype
        self.use_chat_template = use_chat_template
        self._loaded: dict[str, Actor] = {}

    def actor(self, name: str | None) -> Actor:
        from magrpo.loading import load_policies
        from magrpo.models import resolve_model

        path = resolve_model(name)
        if path not in self._loaded:
            policies = load_policies(
                ["model"],
                [path],
                finetune="full",
                dtype=self.dtype,
                use_chat_template=self.use_chat_template,
            )
            self._loaded[path] = Actor(policies, "model")
        return self._loaded[path]


# --- the evaluation ----------------------------------------------------------------------------


@dataclass
class EvalResult:
    settings: EvalSettings
    env_id: str
    split: str
    problems: int
    family: str
    rows: dict[str, dict[str, float]]  # protocol -> metrics
    timing: dict[str, dict[str, float]]  # protocol -> timing
    output_dir: Path

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env_id,
            "split": self.split,
            "problems": self.problems,
            "family": self.family,
            "settings": asdict(self.settings),
            "protocols": {
                name: {"metrics": self.rows[name], "timing": self.timing[name]}
                for name in self.rows
            },
        }


def make_env(settings: EvalSettings):
    import llm_marl_envs

    env_id = llm_marl_envs.resolve_env_id(settings.env)
    split = settings.split or llm_marl_envs.default_eval_split(env_id)
    kwargs: dict[str, Any] = {"split": split, "max_turns": settings.turns}
    if settings.data is not None:
        kwargs["data"] = settings.data
    return llm_marl_envs.make(env_id, **kwargs), env_id, split


def problem_list(env: Any, settings: EvalSettings) -> list[tuple[int | None, int]]:
    num_items = getattr(env, "num_items", None)
    if isinstance(num_items, int) and not isinstance(num_items, bool):
        count = num_items if settings.limit is None else min(settings.limit, num_items)
        return [(i, settings.seed + i) for i in range(count)]
    if settings.limit is None:
        raise EvaluationError(
            "This env does not say how many problems it has (no num_items): pass --limit N to "
            "evaluate N episodes from seeds."
        )
    return [(None, settings.seed + i) for i in range(settings.limit)]


def evaluate(
    settings: EvalSettings,
    env: Any | None = None,
    *,
    untrained: ModelPool | None = None,
    trained_policies: Any | None = None,
    on_protocol: Callable[[EvalResult], Any] | None = None,
) -> EvalResult:
    """Run every protocol of ``settings``; ``env``/``trained_policies`` may be given directly.

    ``on_protocol`` gets the partial result after each protocol (the CLI writes the files
    then, so a long run that is stopped keeps the protocols it finished).
    """
    import torch

    from magrpo.policies import SamplingParams

    check_settings(settings)
    if env is None:
        env, env_id, split = make_env(settings)
    else:
        env_id, split = type(env).__name__, settings.split or "-"
    agents = list(env.possible_agents)
    if settings.models is not None and len(settings.models) != len(agents):
        raise EvaluationError(
            f"--models lists {len(settings.models)} model(s) but {env_id} has {len(agents)} "
            f"agents ({', '.join(agents)}): give one model per agent, in that order."
        )
    problems = problem_list(env, settings)
    run_config: dict[str, Any] = {}
    if "trained" in settings.protocols and trained_policies is None:
        run_config = find_trained(settings.adapters, agents).run_config
        trained_policies = load_trained(settings, agents)
    chat = settings.chat_template
    pool = untrained or ModelPool(
        settings.dtype, run_config.get("use_chat_template", True) if chat is None else chat
    )
    default_model = settings.model or run_config.get("model")
    names = settings.models or [default_model] * len(agents)
    params = SamplingParams(settings.max_new_tokens, settings.temperature, settings.top_p)
    output_dir = Path(settings.output_dir or f"runs/eval/{env_id}")
    rows: dict[str, dict[str, float]] = {}
    timing: dict[str, dict[str, float]] = {}
    samples_file = None
    if settings.save_samples:
        output_dir.mkdir(parents=True, exist_ok=True)
        samples_file = open(output_dir / "samples.jsonl", "w")  # noqa: SIM115 - closed below
    total = len(settings.protocols) * len(problems) * settings.samples
    family = "generic"
    progress = _progress(settings.progress, total)
    executor = ThreadPoolExecutor(max_workers=settings.workers)
    try:
        for protocol in settings.protocols:
            if protocol == "trained":
                actors = {a: Actor(trained_policies, a) for a in agents}
            else:
                actors = {a: pool.actor(n) for a, n in zip(agents, names, strict=True)}
            single_actor = (
                pool.actor(settings.single_model or default_model) if protocol == "single" else None
            )
            generator = Generator(params, settings.max_batch, settings.per_agent_timing)
            if progress is not None:
                progress.set_description(f"{protocol}: generating")
                generator.on_call = lambda rows, p=protocol: progress.set_description(
                    f"{p}: generating {rows}"
                )
            torch.manual_seed(settings.seed)
            started = time.perf_counter()
            episodes = run_protocol(
                protocol,
                env,
                problems,
                actors,
                generator,
                executor,
                settings.samples,
                single_actor=single_actor,
                on_scored=None if progress is None else _scored_callback(progress, protocol),
            )
            seconds = time.perf_counter() - started
            family = task_family(episodes)
            rows[protocol] = compute_metrics(episodes, settings.ks(), settings.turns)
            timing[protocol] = _timing(generator.stats, len(episodes), seconds)
            rows[protocol]["seconds_per_sample"] = timing[protocol]["seconds_per_sample"]
            if samples_file is not None:
                for episode in episodes:
                    index = problems[episode.problem][0]
                    record = {"protocol": protocol, "problem": index, **asdict(episode)}
                    samples_file.write(json.dumps(record) + "\n")
                samples_file.flush()
            if on_protocol is not None:
                on_protocol(
                    EvalResult(
                        settings, env_id, split, len(problems), family, rows, timing, output_dir
                    )
                )
    finally:
        executor.shutdown(wait=True)
        if progress is not None:
            progress.close()
        if samples_file is not None:
            samples_file.close()
    return EvalResult(settings, env_id, split, len(problems), family, rows, timing, output_dir)


def _timing(stats: ProtocolStats, num_samples: int, seconds: float) -> dict[str, float]:
    return {
        "seconds_per_sample": stats.latency / num_samples,
        "generation_seconds_per_sample": stats.generation / num_samples,
        "scoring_seconds_per_sample": stats.scoring / num_samples,
        "latency_seconds": stats.latency,
        "generation_seconds": stats.generation,
        "scoring_seconds": stats.scoring,
        "total_seconds": seconds,
        "generated_tokens": float(stats.generated_tokens),
        "generate_calls": float(stats.calls),
        "phases": float(stats.phases),
    }


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="evaluate", unit="sample", dynamic_ncols=True, file=sys.stderr)


def _scored_callback(progress, protocol: str):
    def scored(count: int) -> None:
        progress.set_description(f"{protocol}: scoring", refresh=False)
        progress.update(count)

    return scored


# --- tables ------------------------------------------------------------------------------------


def table_columns(family: str, ks: list[int], row_keys: set[str]) -> list[tuple[str, str, str]]:
    """(metric key, header, format) of the table; format 'pct' | 'num' | 'sec'."""
    if family == "coding":
        columns = [
            ("structure", "structure", "pct"),
            ("syntax", "syntax", "pct"),
            ("tests", "tests passed", "pct"),
        ]
        columns += [(f"pass@{k}", f"pass@{k}", "pct") for k in ks]
        columns += [(f"best_tests@{k}", f"best tests@{k}", "pct") for k in ks]
        columns += [("cooperation_rate", "cooperation", "pct"), ("return", "return (max 4)", "num")]
    elif family == "writing":
        columns = [
            ("structure", "structure (L1-3)", "pct"),
            ("consistency", "style consistency", "pct"),
            ("coherence", "coherence", "pct"),
            ("length_ratio", "length ratio", "num"),
            ("return", "return (max 3)", "num"),
        ]
    else:
        parts = sorted(k for k in row_keys if k.startswith("part/"))
        columns = [(k, k.removeprefix("part/"), "num") for k in parts]
        columns.append(("return", "return", "num"))
    columns.append(("seconds_per_sample", "s/sample", "sec"))
    return columns


def _format(value: float | None, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "sec":
        return f"{value:.2f}"
    return f"{value:.3f}"


def markdown_table(result: EvalResult) -> str:
    keys = {k for row in result.rows.values() for k in row}
    columns = table_columns(result.family, result.settings.ks(), keys)
    lines = [
        "| protocol | " + " | ".join(header for _, header, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for protocol, row in result.rows.items():
        cells = [_format(row.get(key), kind) for key, _, kind in columns]
        lines.append(f"| {protocol} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(result: EvalResult) -> str:
    s = result.settings
    return (
        f"{result.env_id}, split {result.split!r}, {result.problems} problems x {s.samples} "
        f"samples, {s.turns} turn(s); temperature {s.temperature}, top_p {s.top_p}, "
        f"{s.max_new_tokens} new tokens; models: {s.models or s.model or 'default'}"
        + (f"; trained: {s.adapters}" if s.adapters else "")
    )


def write_outputs(result: EvalResult) -> list[Path]:
    from magrpo.plot import plot_eval

    out = result.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result.to_json(), indent=2))
    (out / "results.md").write_text(
        f"# Evaluation: {result.env_id}\n\n{describe(result)}\n\n{markdown_table(result)}\n\n"
        "s/sample: seconds of generation per joint sample, the slowest agent's share of each "
        "phase (see magrpo/protocols.py).\n"
    )
    return [out / "results.json", out / "results.md", *plot_eval(result.to_json(), out)]


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m magrpo.evaluate",
        description="Evaluate the paper's protocols on a PettingZoo text env: tables and charts.",
    )
    add_dataclass_arguments(parser, EvalSettings)
    return parser


def settings_from_args(argv: list[str] | None = None) -> EvalSettings:
    values = split_commas(vars(build_parser().parse_args(argv)))
    protocols = values.get("protocols")
    values["protocols"] = (
        parse_protocols(protocols)
        if protocols
        else [*DEFAULT_BASELINES, *(["trained"] if values.get("adapters") else [])]
    )
    if values.get("k"):
        values["k"] = parse_ks(values["k"])
    return EvalSettings(**values)


def _user_errors() -> tuple[type[BaseException], ...]:
    from llm_marl_envs import LLMMarlEnvError
    from magrpo.errors import ModelLoadError
    from magrpo.models import ModelNotFoundError

    return (EvaluationError, LLMMarlEnvError, ModelLoadError, ModelNotFoundError)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(argv)
        check_settings(settings)
        if settings.torch_threads:
            import torch

            torch.set_num_threads(settings.torch_threads)
        if settings.progress:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # one bar: ours
        result = evaluate(settings, on_protocol=write_outputs)
        files = write_outputs(result)
    except _user_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{describe(result)}\n\n{markdown_table(result)}\n")
    print("written: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
