"""Sample the agents' completions with vLLM instead of Hugging Face ``generate``.

Why: in MAGRPO most of a step's time is spent sampling G completions per agent per prompt.
vLLM's paged attention, continuous batching and prefix caching are built for that throughput
(the speed-up over ``transformers`` is not measured here), and it serves many LoRA adapters
over one frozen base model in the same batch, which is exactly our default setup (one shared
base, one adapter per agent). The training side is unchanged: the Hugging Face model still
computes every log-prob and gradient.

How the weights stay in sync: vLLM cannot see the trainer's tensors, so after every optimizer
step :meth:`VLLMSampler.sync` saves each agent's adapter (peft format, a few MB) to a fresh
folder and builds new ``LoRARequest`` objects with new integer ids and new names. vLLM caches
adapters by id (and, in recent versions, keys its prefix cache by adapter name), so a new id and
name make it load the new weights and never reuse KV blocks computed with the old ones. The
previous folder is deleted once the new requests replace it; the old adapters simply age out
of vLLM's LRU adapter cache.

Limitations:

* LoRA on one shared base only (``finetune="lora"`` with a single model). Full fine-tuning or
  one model per agent would mean shipping whole weights to vLLM after every step; use the
  Hugging Face sampler (``--generation-backend hf``) for those.
* The samples come from vLLM's kernels (and its dtype), the log-probs from the HF model, so the
  sampling distribution and the one the loss uses differ by a tiny numerical amount. The loss
  only ever uses the HF log-probs (the PPO ratio's "old" log-probs included), so this acts like
  slightly off-policy samples, not like a wrong gradient.
* A CUDA GPU is required; vLLM shares it with the trainer, hence ``gpu_memory_utilization``.

vLLM is imported inside :class:`VLLMSampler` only, so this module imports on any machine.
"""

from __future__ import annotations

import gc
import itertools
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magrpo.answers import completion_from_ids
from magrpo.config import ConfigError
from magrpo.rollout import Completion

if TYPE_CHECKING:
    from magrpo.policies import LoadedModel, Policies, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["VLLMSampler", "VLLMUnavailableError", "completion_from_vllm"]

VLLM_MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank`` (``LoRAConfig``); adapters of any rank up to the
chosen value can be served, so we pick the smallest one that covers every agent's adapter."""

_INT64_MAX = 2**63 - 1


class VLLMUnavailableError(RuntimeError):
    """vLLM cannot run on this machine (package missing or no CUDA GPU); the message says how
    to fix it, so the trainer can show it as is."""


@dataclass(frozen=True)
class _VLLMApi:
    """The few vLLM names we use, imported lazily: the import is slow and fails without vLLM."""

    LLM: Any
    SamplingParams: Any
    TokensPrompt: Any
    LoRARequest: Any


class VLLMSampler:
    """Samples the agents' completions with vLLM: the frozen base served once, one LoRA per agent.

    A drop-in for :meth:`Policies.sample`: same requests, same :class:`Completion` conventions
    (prompt ids from ``policies.encode_prompt``, completion ids up to and including the first
    EOS), so the HF model's log-probs later cover exactly the tokens vLLM sampled. Call
    :meth:`sync` after every optimizer step, and :meth:`close` at the end (or use ``with``).
    Extra keyword arguments go to ``vllm.LLM`` unchanged (e.g. ``enforce_eager=True``).
    """

    def __init__(
        self,
        policies: Policies,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        max_model_len: int | None = None,
        **engine_kwargs: Any,
    ):
        # The mode check comes first: it is a configuration error on any machine.
        self.backend: LoadedModel = _shared_lora_backend(policies)
        self._api = import_vllm()
        self.policies = policies
        self.agents = list(self.backend.agents)
        _warn_if_other_base(self.backend, model_path)
        settings: dict[str, Any] = {
            "model": str(model_path),
            "enable_lora": True,
            "max_loras": len(self.agents),  # every agent's adapter in one batch
            "max_lora_rank": _vllm_max_lora_rank(self.backend),
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed,
        }
        if max_model_len is not None:
            settings["max_model_len"] = max_model_len
        settings.update(engine_kwargs)
        self._workdir = tempfile.TemporaryDirectory(prefix="magrpo-vllm-")
        self._ids = itertools.count(1)  # vLLM rejects lora_int_id < 1
        self._version = 0
        self._folder: Path | None = None
        self._lora: dict[str, Any] = {}
        logger.info("Starting vLLM for %s (%s)", model_path, settings)
        self.llm: Any = self._api.LLM(**settings)
        self.sync()

    # --- sampling ------------------------------------------------------------------------
    def sample(
        self,
        requests: Sequence[tuple[str, str]],
        num_samples: int,
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``num_samples`` completions per (agent, observation), all in one ``generate`` call.

        With ``seeds`` (one per request) each request's samples depend on its seed, not on the
        batch: vLLM gives sample k of a request the seed ``seed + k``, which is why seeds
        should be well mixed (the trainer's are 63-bit hashes) rather than consecutive.
        """
        if self.llm is None:
            raise RuntimeError("this VLLMSampler is closed")
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        if seeds is not None and len(seeds) != len(requests):
            raise ValueError(f"got {len(seeds)} seeds for {len(requests)} requests")
        if not requests:
            return []
        unknown = sorted({agent for agent, _ in requests} - set(self._lora))
        if unknown:
            raise ValueError(f"unknown agent(s) {unknown}; the policies have {self.agents}")
        greedy = params.temperature <= 0
        # vLLM rejects n > 1 with greedy decoding; greedy samples are identical anyway, so
        # one is generated and copied (the HF sampler computes them all, to the same result).
        n = 1 if greedy else num_samples
        settings = _sampling_settings(params, n, self.backend.eos_ids)
        stops = [list(params.stop.get(agent, ())) for agent, _ in requests]
        if (seeds is None or greedy) and not any(stops):
            sampling: Any = self._api.SamplingParams(**settings)
        else:  # one per request: its own seed, its agent's stop strings
            sampling = [
                self._api.SamplingParams(
                    **settings,
                    **({} if seeds is None or greedy else {"seed": _vllm_seed(seed, n)}),
                    **({"stop": stop, "include_stop_str_in_output": True} if stop else {}),
                )
                for seed, stop in zip(seeds or [0] * len(requests), stops, strict=True)
            ]
        prompts = [self.policies.encode_prompt(agent, text) for agent, text in requests]
        outputs = self.llm.generate(
            [self._api.TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
            sampling,
            lora_request=[self._lora[agent] for agent, _ in requests],
            use_tqdm=False,
        )
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
        tokenizer = self.backend.tokenizer
        primary_eos = tokenizer.eos_token_id
        results: list[list[Completion]] = []
        for (agent, _), prompt, output in zip(requests, prompts, outputs, strict=True):
            samples = sorted(output.outputs, key=lambda sample: sample.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples, expected {n}")
            group = [
                completion_from_vllm(
                    agent,
                    prompt,
                    sample.token_ids,
                    sample.finish_reason,
                    sample.stop_reason,
                    self.backend.eos_ids,
                    tokenizer,
                    primary_eos,
                    params.stop.get(agent, ()),
                )
                for sample in samples
            ]
            if greedy:
                only = group[0]
                group = [
                    Completion(agent, only.text, prompt, list(only.completion_ids), only.finished)
                    for _ in range(num_samples)
                ]
            results.append(group)
        return results

    # --- weights -------------------------------------------------------------------------
    def sync(self) -> None:
        """Make vLLM serve the agents' current adapters (call after every optimizer step).

        Each version gets new ids and names: reusing them would serve the cached old weights.
        """
        self._version += 1
        folder = Path(self._workdir.name) / f"v{self._version}"
        lora = {}
        for agent in self.agents:
            path = self.policies.save_agent(agent, folder)
            lora[agent] = self._api.LoRARequest(
                lora_name=f"{self.backend.adapter[agent]}-v{self._version}",
                lora_int_id=next(self._ids),
                lora_path=str(path),
            )
        previous, self._folder, self._lora = self._folder, folder, lora
        if previous is not None:
            # Safe: generate() is synchronous, so no pending request still needs these files.
            shutil.rmtree(previous, ignore_errors=True)

    # --- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop vLLM's engine (it holds GPU memory and a worker process) and delete the adapters.

        Idempotent. Recent vLLM has ``LLM.shutdown()``; the V1 engine of older releases is
        stopped through its engine-core client; otherwise releasing the object is all we can do.
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(llm, "shutdown", None)
            if shutdown is None:
                engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
                shutdown = getattr(engine_core, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception as error:  # noqa: BLE001 - closing must not mask the caller's error
                    logger.warning("vLLM shutdown failed: %s: %s", type(error).__name__, error)
            del llm
            gc.collect()
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        self._lora = {}
        self._folder = None
        self._workdir.cleanup()

    def __enter__(self) -> VLLMSampler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- helpers (module level so they can be tested without vLLM) -------------------------------
def start_vllm(policies: Policies, model_paths: list[str], config: Any) -> VLLMSampler:
    """vLLM serving the trainer's shared base and adapters (``--generation-backend vllm``)."""
    if not model_paths:
        raise ConfigError(
            "--generation-backend vllm starts vLLM from the model's files, but the trainer "
            "was given ready-made policies: let it load them (--model), or use the hf backend."
        )
    return VLLMSampler(
        policies,
        model_paths[0],
        dtype=config.dtype,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        seed=config.seed,
    )


def completion_from_vllm(
    agent: str,
    prompt_ids: list[int],
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_reason: int | str | None,
    eos_ids: Sequence[int],
    tokenizer: Any,
    primary_eos: int | None = None,
    stop: Sequence[str] = (),
) -> Completion:
    """One vLLM ``CompletionOutput`` in our convention: ids up to and including the first EOS.

    vLLM (V1 engine) keeps the stop token in ``token_ids`` and drops it from the text only; if
    a version dropped it from the ids too (``finish_reason == "stop"`` with no EOS at the end),
    it is put back, because the decision to stop is an action that must get its log-prob.
    ``finished`` comes from the ids, not from ``finish_reason``: some vLLM versions check the
    length limit first and report "length" for an EOS drawn as the last allowed token.
    """
    ids = [int(token) for token in token_ids]
    eos = set(eos_ids)
    if finish_reason == "stop" and not eos.intersection(ids):  # the stop token was dropped
        if isinstance(stop_reason, int) and stop_reason in eos:
            ids.append(stop_reason)
        elif stop_reason is None:  # stopped on the model's own EOS token
            fallback = primary_eos if primary_eos in eos else min(eos_ids, default=None)
            if fallback is not None:
                ids.append(fallback)
    return completion_from_ids(agent, prompt_ids, ids, eos_ids, tokenizer, stop)


def _sampling_settings(params: SamplingParams, n: int, eos_ids: Sequence[int]) -> dict[str, Any]:
    """Our sampling parameters as ``vllm.SamplingParams`` keyword arguments.

    top_k "off" is -1: vLLM < ~0.9 rejects 0 and newer versions accept -1 as well. Greedy sets
    top_p/top_k to their neutral values because old versions reject anything else with it.
    EOS ids are passed as stop tokens so vLLM stops on exactly the ids the HF sampler does
    (vLLM adds the tokenizer's and generation config's EOS on its own; this covers the rest).
    """
    greedy = params.temperature <= 0
    return {
        "n": n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 and not greedy else -1,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": [int(token) for token in eos_ids],
    }


def _vllm_seed(seed: int, n: int) -> int:
    # vLLM seeds sample k with seed + k; keep that within int64 (torch generators, msgpack).
    return int(seed) % (_INT64_MAX - n)


def _shared_lora_backend(policies: Policies) -> LoadedModel:
    backends = policies.models
    if len(backends) == 1 and backends[0].mode == "shared_lora":
        return backends[0]
    found = "; ".join(f"{b.mode} for {', '.join(b.agents)}" for b in backends)
    raise ConfigError(
        "The vLLM generation backend supports only LoRA agents on one shared base model "
        f"(finetune=lora with a single --model), but these policies are: {found}. vLLM serves "
        "one frozen base and reloads only the small per-agent adapters after each step; full "
        "fine-tuning or a separate model per agent would need whole models reloaded every "
        "step, which this backend does not do. Use `--generation-backend hf` for this setup."
    )


def import_vllm() -> _VLLMApi:
    """vLLM's entry points, or VLLMUnavailableError saying what is missing (checked before
    any model is loaded, so a run without vLLM fails in seconds, not after a 7B load)."""
    problems = []
    api = None
    try:
        import vllm
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        api = _VLLMApi(vllm.LLM, vllm.SamplingParams, TokensPrompt, LoRARequest)
    except (
        ImportError,
        OSError,
    ) as error:  # OSError: a vllm build whose CUDA libraries are missing
        problems.append(f"the vllm package cannot be imported ({type(error).__name__}: {error})")
    if not _cuda_available():
        problems.append("PyTorch sees no CUDA GPU")
    if problems or api is None:
        raise VLLMUnavailableError(
            f"The vLLM generation backend cannot run here: {'; and '.join(problems)}. vLLM "
            "samples on CUDA GPUs only. To fix: on a machine with a CUDA GPU, install the extra "
            'with `pip install "llm-marl[vllm]"` (from a checkout: `pip install -e '
            '".[train,vllm]"`), or sample with the Hugging Face model instead, which works '
            "anywhere, with `--generation-backend hf`."
        )
    return api


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _vllm_max_lora_rank(backend: LoadedModel) -> int:
    ranks = []
    for name in backend.adapter.values():
        config = backend.model.peft_config[name]
        ranks.append(max([int(config.r), *(int(r) for r in (config.rank_pattern or {}).values())]))
    rank = max(ranks)
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(
        f"The agents' LoRA rank {rank} is above {VLLM_MAX_LORA_RANKS[-1]}, the largest rank vLLM "
        "serves. Use a smaller --lora-rank, or `--generation-backend hf`."
    )


def _warn_if_other_base(backend: LoadedModel, model_path: str) -> None:
    """vLLM would silently apply the adapters to whatever base it is given: say so if it differs."""
    config = next(iter(backend.model.peft_config.values()))
    base = getattr(config, "base_model_name_or_path", None)
    if base and Path(base).expanduser().resolve() != Path(model_path).expanduser().resolve():
        logger.warning(
            "vLLM serves %s but the adapters were trained on %s; samples will not match the "
            "trained policy unless these are the same model.",
            model_path,
            base,
        )
