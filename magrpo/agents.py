"""The N agent policies: sampling and batched, mask-aware token log-probabilities.

Default (``finetune="lora"``, one model): one frozen base model shared by every agent, one
LoRA adapter per agent (peft named adapters). A batch may mix agents: peft's
``adapter_names=`` routes each row through its own adapter, so the G samples of *all*
agents come from one ``generate`` call and their log-probs from one forward pass. Memory is
about one model. ``finetune="full"`` or a list of models gives one model per agent
(heterogeneous models and tokenizers are fine); batches are then per agent.

Sequence layout for log-probs: [left padding | prompt | completion | right padding]. The
completion's extent comes from its length (tokens up to and including its first EOS), never
from searching pad ids (SmolLM2's pad == eos == <|im_end|>, which also occurs in prompts).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from magrpo.losses import completion_length, completion_mask, token_logprobs
from magrpo.rollout import Completion

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class LogprobBatch:
    """Token log-probs of a micro-batch of completions: ``logprobs``/``mask`` are [B, T]."""

    logprobs: torch.Tensor
    mask: torch.Tensor


class _Backend:
    """One loaded model (+ tokenizer) serving one or more agents."""

    def __init__(self, model, tokenizer, agents: list[str], mode: str, reference=None):
        self.model = model
        self.tokenizer = tokenizer
        self.agents = agents
        self.mode = mode  # "shared_lora" | "lora" | "full"
        self.reference = reference  # frozen copy, only for full fine-tuning with a KL term
        self.adapter = {agent: _adapter_name(agent) for agent in agents}
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = int(tokenizer.pad_token_id)
        eos: set[int] = set()
        for source in (
            tokenizer.eos_token_id,
            getattr(model.generation_config, "eos_token_id", None),
        ):
            if source is not None:
                eos.update([source] if isinstance(source, int) else source)
        self.eos_ids = sorted(eos)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def adapter_kwargs(self, agents: Sequence[str], reference: bool = False) -> dict:
        if self.mode != "shared_lora":
            return {}
        names = ["__base__" if reference else self.adapter[a] for a in agents]
        return {"adapter_names": names}

    def pad_batch(
        self, prompts: Sequence[list[int]], completions: Sequence[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Left-pad prompts, right-pad completions; returns ids, attention mask, prompt width."""
        width = max(len(p) for p in prompts)
        tail = max((len(c) for c in completions), default=0) if completions else 0
        ids = torch.full((len(prompts), width + tail), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) : width] = 1
            if completions:
                completion = completions[row]
                ids[row, width : width + len(completion)] = torch.tensor(
                    completion, dtype=torch.long
                )
                mask[row, width : width + len(completion)] = 1
        return ids.to(self.device), mask.to(self.device), width


def _adapter_name(agent: str) -> str:
    return re.sub(r"\W", "_", agent) or "agent"


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


class Policies:
    """The agents' policies. Build with :func:`load_policies` (or directly from models)."""

    def __init__(self, backends: list[_Backend], use_chat_template: bool = True):
        self.backends = backends
        self.use_chat_template = use_chat_template
        self.backend_of = {agent: b for b in backends for agent in b.agents}
        self.agents = [agent for b in backends for agent in b.agents]

    # --- text <-> tokens -----------------------------------------------------------------
    def encode_prompt(self, agent: str, observation: str) -> list[int]:
        tokenizer = self.backend_of[agent].tokenizer
        if self.use_chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": observation}],
                tokenize=False,
                add_generation_prompt=True,
            )
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(observation)["input_ids"])

    # --- sampling ------------------------------------------------------------------------
    def sample(
        self, requests: Sequence[tuple[str, str]], num_samples: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """``num_samples`` completions per (agent, observation); one generate call per model."""
        results: list[list[Completion]] = [[] for _ in requests]
        for backend in self.backends:
            rows = [i for i, (agent, _) in enumerate(requests) if agent in backend.adapter]
            if not rows:
                continue
            prompts = [self.encode_prompt(*requests[i]) for i in rows]
            batch_prompts = [p for p in prompts for _ in range(num_samples)]
            batch_agents = [requests[i][0] for i in rows for _ in range(num_samples)]
            outputs = self._generate(backend, batch_agents, batch_prompts, params)
            for k, completion_ids in enumerate(outputs):
                request_index = rows[k // num_samples]
                length = completion_length(completion_ids, backend.eos_ids)
                kept = completion_ids[:length]
                text = backend.tokenizer.decode(kept, skip_special_tokens=True)
                finished = length > 0 and kept[-1] in backend.eos_ids
                results[request_index].append(
                    Completion(batch_agents[k], text, batch_prompts[k], kept, finished)
                )
        return results

    @torch.inference_mode()
    def _generate(
        self,
        backend: _Backend,
        agents: list[str],
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> list[list[int]]:
        input_ids, attention_mask, width = backend.pad_batch(prompts)
        greedy = params.temperature == 0
        sampling = (
            {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            if greedy
            else {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
            }
        )
        output = backend.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            pad_token_id=backend.pad_id,
            eos_token_id=backend.eos_ids,
            **sampling,
            **backend.adapter_kwargs(agents),
        )
        return output[:, width:].tolist()

    # --- log-probs -----------------------------------------------------------------------
    def logprobs(self, completions: Sequence[Completion], reference: bool = False) -> LogprobBatch:
        """Token log-probs of completions that share one model (one forward pass).

        ``reference=True``: the reference policy (LoRA: the base, adapters off), no grad.
        """
        backend = self.backend_of[completions[0].agent]
        agents = [c.agent for c in completions]
        if any(self.backend_of[a] is not backend for a in agents):
            raise ValueError("a log-prob batch must come from one model; see group_key()")
        input_ids, attention_mask, width = backend.pad_batch(
            [c.prompt_ids for c in completions], [c.completion_ids for c in completions]
        )
        tail = input_ids.shape[1] - width
        grad = torch.no_grad() if reference else contextlib.nullcontext()
        with grad, self._reference_context(backend, reference) as model:
            output = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=_position_ids(attention_mask),
                logits_to_keep=tail + 1,
                use_cache=False,
                **backend.adapter_kwargs(agents, reference=reference),
            )
        targets = input_ids[:, width:]
        logprobs = token_logprobs(output.logits[:, :-1], targets)
        lengths = torch.tensor([len(c.completion_ids) for c in completions], device=targets.device)
        return LogprobBatch(logprobs, completion_mask(targets, lengths))

    @contextlib.contextmanager
    def _reference_context(self, backend: _Backend, reference: bool) -> Iterator[torch.nn.Module]:
        if not reference or backend.mode == "shared_lora":
            yield backend.model
        elif backend.mode == "lora":
            with backend.model.disable_adapter():
                yield backend.model
        else:
            if backend.reference is None:
                raise ValueError("a full fine-tuning reference model was not loaded (kl_coef=0?)")
            yield backend.reference

    def group_key(self, agent: str) -> int:
        """Completions with the same key can share one forward pass."""
        return self.backends.index(self.backend_of[agent])

    # --- parameters, saving --------------------------------------------------------------
    def named_trainable_parameters(self, agent: str) -> dict[str, torch.nn.Parameter]:
        backend = self.backend_of[agent]
        if backend.mode == "shared_lora":
            tag = f".{backend.adapter[agent]}."
            return {
                name: p
                for name, p in backend.model.named_parameters()
                if "lora_" in name and tag in name
            }
        return {name: p for name, p in backend.model.named_parameters() if p.requires_grad}

    def save_agent(self, agent: str, directory: str | Path) -> Path:
        """Standard format: a peft adapter folder (LoRA) or a full model folder, + tokenizer."""
        backend = self.backend_of[agent]
        directory = Path(directory)
        if backend.mode == "full":
            target = directory / agent
            backend.model.save_pretrained(target)
        else:
            # peft writes non-"default" adapters into <directory>/<adapter name>/
            backend.model.save_pretrained(directory, selected_adapters=[backend.adapter[agent]])
            target = directory / backend.adapter[agent]
        backend.tokenizer.save_pretrained(target)
        return target


def _load_model(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - any loader failure becomes one clear message
        raise ModelLoadError(
            f"Could not load the model or tokenizer at {path!r}: {type(error).__name__}: "
            f"{error}. Pass --model with a local folder that holds config.json, weights and "
            "tokenizer files (or a Hugging Face id available offline in the cache)."
        ) from error
    return model.to(device), tokenizer


def _lora_config(rank: int, alpha: float, target_modules: Sequence[str]):
    from peft import LoraConfig

    targets = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    return LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )


def load_policies(
    agents: Sequence[str],
    model_paths: Sequence[str],
    *,
    finetune: str = "lora",
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_target_modules: Sequence[str] = ("q_proj", "v_proj"),
    dtype: str = "float32",
    use_chat_template: bool = True,
    need_reference: bool = False,
    device: torch.device | str = "cpu",
) -> Policies:
    """Load the policies. ``model_paths``: one per agent (identical paths + LoRA: shared)."""
    from peft import get_peft_model

    agents = list(agents)
    if len(model_paths) != len(agents):
        raise ModelLoadError(
            f"Got {len(model_paths)} model(s) for {len(agents)} agents ({', '.join(agents)}): "
            "pass one --model for all agents or exactly one --models entry per agent."
        )
    torch_dtype = DTYPES[dtype]
    device = torch.device(device)
    lora = _lora_config(lora_rank, lora_alpha, lora_target_modules)
    backends: list[_Backend] = []
    if finetune == "lora" and len(set(model_paths)) == 1:
        base, tokenizer = _load_model(model_paths[0], torch_dtype, device)
        names = [_adapter_name(a) for a in agents]
        if len(set(names)) != len(names):
            raise ModelLoadError(f"Agent names {agents} collide as adapter names {names}.")
        model = get_peft_model(base, copy.deepcopy(lora), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, copy.deepcopy(lora))
        model.set_requires_grad(names, requires_grad=True)
        model.eval()  # no dropout; and peft mixes adapters in a batch only in eval mode
        backends.append(_Backend(model, tokenizer, agents, "shared_lora"))
    else:
        for agent, path in zip(agents, model_paths, strict=True):
            model, tokenizer = _load_model(path, torch_dtype, device)
            reference = None
            if finetune == "lora":
                model = get_peft_model(
                    model, copy.deepcopy(lora), adapter_name=_adapter_name(agent)
                )
                mode = "lora"
            else:
                mode = "full"
                if need_reference:
                    reference = copy.deepcopy(model).requires_grad_(False).eval()
            model.eval()
            backends.append(_Backend(model, tokenizer, [agent], mode, reference))
    policies = Policies(backends, use_chat_template)
    for agent in agents:
        count = sum(p.numel() for p in policies.named_trainable_parameters(agent).values())
        logger.info("agent %s: %s trainable parameters", agent, f"{count:,}")
    return policies
