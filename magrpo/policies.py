"""The N agent policies: sampling, and batched, mask-aware token log-probabilities.

Default (``finetune="lora"``, one model): one frozen base model shared by every agent, one
LoRA adapter per agent (peft named adapters). A batch may mix agents: each row runs through
its own agent's adapter (``lora_routing``), so the G samples of *all* agents come from one
decode loop and their log-probs from one forward pass. Memory is about one model.
``finetune="full"`` or a list of models gives one model per agent (heterogeneous models and
tokenizers are fine); batches are then per model.

Sampling is our own decode loop (a forward, the sampler, and the stop bookkeeping per
token) on transformers' static cache; the G samples of a prompt share its prefill.
Log-probs: each distinct prompt runs once (left-padded), and its KV cache is shared by the
completions sampled from it, which run right-padded on top. A completion's extent comes
from its length (tokens up to and including its first EOS), never from searching pad ids
(SmolLM2's pad == eos == <|im_end|>, which also occurs in prompts).

That is the plain path. Faster equivalents of the decode forward and of the log-prob pass
come from ``self.speedups`` (``magrpo.speedups``) when it offers them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from magrpo.answers import check_turn_end, completion_from_ids, ends_an_answer
from magrpo.forwards import last_position_pass, output_cache, position_ids, static_cache_forward
from magrpo.lora_routing import AdapterRouter
from magrpo.losses import completion_mask, token_logprobs
from magrpo.rollout import Completion, derive_seed
from magrpo.sampling import row_generators, sample_tokens
from magrpo.speedups import Speedups

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    #: Per agent: strings after which an answer is complete (an env's ``answer_format``).
    #: The answer ends with the token that completes one; what follows is never generated.
    stop: Mapping[str, Sequence[str]] = field(default_factory=dict)


@dataclass
class LogprobBatch:
    """Token log-probs of a micro-batch of completions: ``logprobs``/``mask`` are [B, T]."""

    logprobs: torch.Tensor
    mask: torch.Tensor


class LoadedModel:
    """One loaded model (+ tokenizer) serving one or more agents."""

    def __init__(self, model, tokenizer, agents: list[str], mode: str, reference=None):
        self.model = model
        self.tokenizer = tokenizer
        self.agents = agents
        self.mode = mode  # "shared_lora" | "lora" | "full"
        self.reference = reference  # frozen copy, only for full fine-tuning with a KL term
        self.adapter = {agent: adapter_name(agent) for agent in agents}
        self.router = (
            AdapterRouter(model, [self.adapter[a] for a in agents])
            if mode == "shared_lora"
            else None
        )
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
        forward = (
            model.get_base_model().forward if hasattr(model, "get_base_model") else model.forward
        )
        parameters = inspect.signature(forward).parameters
        self.cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def routed(self, agents: Sequence[str], reference: bool = False):
        """Within the block, row i of a shared-base batch runs agent i's adapter (or none)."""
        if self.router is None:
            return contextlib.nullcontext()
        names = [None if reference else self.adapter[a] for a in agents]
        return self.router.route(names, self.device)

    def pad_batch(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Left-pad prompts; returns ids, attention mask and the padded width."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device), width

    @contextlib.contextmanager
    def policy(self, reference: bool) -> Iterator[torch.nn.Module]:
        """The model to run: the agents' policy, or (``reference``) the reference policy
        (LoRA: the base with the adapters off; full fine-tuning: the frozen copy)."""
        if not reference or self.mode == "shared_lora":  # shared LoRA: routed to no adapter
            yield self.model
        elif self.mode == "lora":
            with self.model.disable_adapter():
                yield self.model
        else:
            if self.reference is None:
                raise ValueError("a full fine-tuning reference model was not loaded (kl_coef=0?)")
            yield self.reference


@dataclass
class DecodeBatch:
    """What one model's decode loop samples: ``num_samples`` rows per prompt, rows grouped
    by prompt. ``input_ids``/``attention_mask``: the left-padded prompts [P, width];
    ``mask``: every row's attention mask over prompt and new tokens [P*G, width + max new]."""

    loaded: LoadedModel
    agents: list[str]  # per prompt
    row_agents: list[str]  # per row
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    width: int
    num_samples: int
    max_new_tokens: int
    mask: torch.Tensor


@dataclass
class Decoding:
    """A ready decode forward: ``forward(ids, positions)`` gives the next-token logits of
    every row; the loop starts from ``step_ids`` at ``positions``."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step_ids: torch.Tensor
    positions: torch.Tensor


@dataclass
class LogprobInputs:
    """A micro-batch of completions of one model, laid out for the log-prob pass: the
    distinct (agent, prompt) pairs once each (``unique``), ``rows`` mapping each completion
    to its prompt, the completions' tokens right-padded (``targets`` [B, T]) and ``mask``."""

    loaded: LoadedModel
    completions: Sequence[Completion]
    agents: list[str]
    keys: list[tuple[str, tuple[int, ...]]]
    unique: list[tuple[str, tuple[int, ...]]]
    rows: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    @property
    def prompt_agents(self) -> list[str]:
        return [agent for agent, _ in self.unique]

def adapter_name(agent: str) -> str:
    return re.sub(r"\W", "_", agent) or "agent"


def _is_adapter_parameter(name: str, adapter: str) -> bool:
    """``...q_proj.lora_A.<adapter>.weight``: matched by path component, not substring (an
    agent named ``model`` must not take ``base_model.model.*`` of every adapter)."""
    parts = name.split(".")
    return any(
        part.startswith("lora_") and following == adapter
        for part, following in zip(parts, parts[1:], strict=False)
    )


class Policies:
    """The agents' policies. Build with :func:`load_policies` (or directly from models)."""

    def __init__(
        self,
        models: list[LoadedModel],
        use_chat_template: bool = True,
        speedups: Speedups | None = None,
    ):
        self.models = models
        self.use_chat_template = use_chat_template
        self.speedups = speedups if speedups is not None else Speedups()
        if use_chat_template:
            for loaded in models:
                check_turn_end(loaded)
        self.model_of = {agent: m for m in models for agent in m.agents}
        self.agents = [agent for m in models for agent in m.agents]

    # --- text <-> tokens -----------------------------------------------------------------
    def encode_prompt(self, agent: str, observation: str) -> list[int]:
        tokenizer = self.model_of[agent].tokenizer
        if self.use_chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": observation}],
                tokenize=False,
                add_generation_prompt=True,
            )
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer(observation)["input_ids"])

    # --- sampling ------------------------------------------------------------------------
    def sample(
        self,
        requests: Sequence[tuple[str, str]],
        num_samples: int,
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``num_samples`` completions per (agent, observation); one decode loop per model.

        ``seeds`` (one per request) make each request's samples a function of its seed
        alone, not of the batch it shares; None draws from torch's global generator.
        """
        results: list[list[Completion]] = [[] for _ in requests]
        jobs, calls = [], []
        for loaded in self.models:
            rows = [i for i, (agent, _) in enumerate(requests) if agent in loaded.adapter]
            if not rows:
                continue
            sample_seeds = (
                None
                if seeds is None
                else [derive_seed(seeds[i], g) for i in rows for g in range(num_samples)]
            )
            agents = [requests[i][0] for i in rows]
            prompts = [self.encode_prompt(*requests[i]) for i in rows]
            jobs.append(
                functools.partial(
                    self._decode_job, loaded, agents, prompts, num_samples, params, sample_seeds
                )
            )
            calls.append((loaded, rows, agents, prompts))
        on_cpu = all(loaded.device.type == "cpu" for loaded, *_ in calls)
        outputs = self.speedups.run_samplers(jobs, seeded=seeds is not None and on_cpu)
        for (loaded, rows, agents, prompts), generated in zip(calls, outputs, strict=True):
            made = []
            for k, completion_ids in enumerate(generated):
                row = k // num_samples
                completion = completion_from_ids(
                    agents[row],
                    prompts[row],
                    completion_ids,
                    loaded.eos_ids,
                    loaded.tokenizer,
                    params.stop.get(agents[row], ()),
                )
                results[rows[row]].append(completion)
                made.append(completion)
            self.speedups.sampled(loaded, made, prompts)
        return results

    @contextlib.contextmanager
    def _decode_job(
        self,
        loaded: LoadedModel,
        agents: list[str],
        prompts: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        sample_seeds: Sequence[int] | None,
    ) -> Iterator[Callable[[], list[list[int]]]]:
        """Prepares sampling ``num_samples`` continuations of each prompt and yields the
        decode loop, which returns their token ids, rows grouped by prompt. Call it within
        the block, from any thread."""
        with torch.inference_mode():
            input_ids, attention_mask, width = loaded.pad_batch(prompts)
            rows = len(prompts) * num_samples
            mask = torch.ones(
                rows, width + params.max_new_tokens, dtype=torch.long, device=input_ids.device
            )
            mask[:, :width] = attention_mask.repeat_interleave(num_samples, dim=0)
            batch = DecodeBatch(
                loaded,
                agents,
                [a for a in agents for _ in range(num_samples)],
                input_ids,
                attention_mask,
                width,
                num_samples,
                params.max_new_tokens,
                mask,
            )
            faster = self.speedups.decoding(self, loaded, batch)
            with faster if faster is not None else self._plain_decoding(batch) as decoding:
                stops = [tuple(params.stop.get(a, ())) for a in batch.row_agents]
                yield functools.partial(
                    self._decode, loaded, decoding, params, sample_seeds, stops
                )

    @contextlib.contextmanager
    def _plain_decoding(self, batch: DecodeBatch) -> Iterator[Decoding]:
        """transformers' forward on a static cache. The G samples of a prompt share its
        prefill: the prompt minus its last token runs once, and the cache starts with G
        copies of it."""
        loaded = batch.loaded
        positions = position_ids(batch.mask[:, : batch.width])
        step_ids = batch.input_ids.repeat_interleave(batch.num_samples, dim=0)
        prefix = None
        if batch.width > 1 and batch.num_samples > 1:
            with loaded.routed(batch.agents):
                output = last_position_pass(
                    loaded.model, None, batch.input_ids[:, :-1], batch.attention_mask[:, :-1]
                )
            prefix = output_cache(output)
            step_ids, positions = step_ids[:, -1:], positions[:, -1:]
        forward = static_cache_forward(
            loaded, loaded.model, None, batch.mask, prefix, batch.num_samples
        )
        with loaded.routed(batch.row_agents):
            yield Decoding(forward, step_ids, positions)

    @torch.inference_mode()
    def _decode(self, loaded, decoding: Decoding, params, sample_seeds, stops):
        """The sampling loop. A row ends at an EOS token or at the token that completes one
        of its ``stops``."""
        step_ids, positions = decoding.step_ids, decoding.positions
        rows = len(step_ids)
        generators = None
        if params.temperature > 0 and sample_seeds is not None:
            generators = row_generators(sample_seeds, loaded.device)
        eos = torch.tensor(loaded.eos_ids, device=step_ids.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=step_ids.device)
        tokens = []
        for _ in range(params.max_new_tokens):
            logits = decoding.forward(step_ids, positions)
            if params.temperature > 0:
                next_ids = sample_tokens(
                    logits, params.temperature, params.top_p, params.top_k, generators
                )[:, 0]
            else:
                next_ids = logits.argmax(-1)
            next_ids = torch.where(finished, loaded.pad_id, next_ids)
            tokens.append(next_ids)
            finished |= torch.isin(next_ids, eos)
            watched = [row for row in range(rows) if stops[row] and not finished[row]]
            if watched:
                generated = torch.stack(tokens, dim=1)[watched].tolist()
                for row, ids in zip(watched, generated, strict=True):
                    if ends_an_answer(ids, stops[row], loaded.tokenizer):
                        finished[row] = True
            if bool(finished.all()):
                break
            step_ids, positions = next_ids[:, None], positions[:, -1:] + 1
        return torch.stack(tokens, dim=1).tolist() if tokens else [[] for _ in range(rows)]

    # --- log-probs -----------------------------------------------------------------------
    def logprobs(
        self, completions: Sequence[Completion], reference: bool = False, temperature: float = 1.0
    ) -> LogprobBatch:
        """Token log-probs [B, T] of completions that share one model, and their mask.

        ``temperature``: log softmax(logits / T), the distribution the completions were
        sampled from at temperature T (before top-p/top-k truncation); 1: the model's own.
        ``reference=True``: the reference policy, without gradients.

        Each distinct (agent, prompt) is run once; its KV cache (with gradients) is then
        indexed to the rows of its completions, which run in one pass on top of it. The G
        samples of a group thus cost one prompt, not G.
        """
        batch = self._logprob_inputs(completions)
        faster = self.speedups.logprobs(self, batch, reference, temperature)
        if faster is not None:
            return faster
        loaded = batch.loaded
        grad = torch.no_grad() if reference else contextlib.nullcontext()
        with grad, loaded.policy(reference) as model:
            prompt_ids, prompt_mask, _ = loaded.pad_batch([list(p) for _, p in batch.unique])
            with loaded.routed(batch.prompt_agents, reference):
                prompt_out = model(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    position_ids=position_ids(prompt_mask),
                    use_cache=True,
                    logits_to_keep=1,
                )
            cache = output_cache(prompt_out)
            cache.reorder_cache(batch.rows)  # index_select: differentiable, shares the pass
            inputs = completion_inputs(batch, prompt_mask, "input_ids", batch.targets)
            with loaded.routed(batch.agents, reference):
                output = model(**inputs, **{loaded.cache_kwarg: cache})
            logits = torch.cat([prompt_out.logits[batch.rows, -1:], output.logits[:, :-1]], dim=1)
            return LogprobBatch(token_logprobs(logits / temperature, batch.targets), batch.mask)

    def _logprob_inputs(self, completions: Sequence[Completion]) -> LogprobInputs:
        loaded = self.model_of[completions[0].agent]
        agents = [c.agent for c in completions]
        if any(self.model_of[a] is not loaded for a in agents):
            raise ValueError("a log-prob batch must come from one model; see group_key()")
        keys = [(c.agent, tuple(c.prompt_ids)) for c in completions]
        unique = list(dict.fromkeys(keys))
        position = {key: i for i, key in enumerate(unique)}
        device = loaded.device
        width = max(len(c.completion_ids) for c in completions)
        targets = torch.full((len(completions), width), loaded.pad_id, dtype=torch.long)
        for row, completion in enumerate(completions):
            targets[row, : len(completion.completion_ids)] = torch.tensor(completion.completion_ids)
        targets = targets.to(device)
        lengths = torch.tensor([len(c.completion_ids) for c in completions], device=device)
        return LogprobInputs(
            loaded,
            completions,
            agents,
            keys,
            unique,
            torch.tensor([position[key] for key in keys], device=device),
            targets,
            completion_mask(targets, lengths),
        )

    # --- features (the input of critics) --------------------------------------------------
    def feature_size(self, agent: str) -> int:
        return int(self.model_of[agent].model.config.hidden_size)

    def prompt_features(self, agent: str, prompts: Sequence[list[int]]) -> torch.Tensor:
        """The last layer's hidden state at each prompt's last token under ``agent``'s
        policy, [B, hidden] in float32, without gradients: what a value head reads."""
        loaded = self.model_of[agent]
        ids, mask, _ = loaded.pad_batch(prompts)
        with torch.no_grad(), loaded.policy(False) as model, loaded.routed([agent] * len(prompts)):
            output = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids(mask),
                output_hidden_states=True,
                logits_to_keep=1,
            )
        return output.hidden_states[-1][:, -1].float()

    def group_key(self, agent: str) -> int:
        """Completions with the same key can share one forward pass."""
        return self.models.index(self.model_of[agent])

    # --- parameters, saving --------------------------------------------------------------
    def named_trainable_parameters(self, agent: str) -> dict[str, torch.nn.Parameter]:
        loaded = self.model_of[agent]
        if loaded.mode == "shared_lora":
            return {
                name: p
                for name, p in loaded.model.named_parameters()
                if _is_adapter_parameter(name, loaded.adapter[agent])
            }
        return {name: p for name, p in loaded.model.named_parameters() if p.requires_grad}

    def save_agent(self, agent: str, directory: str | Path) -> Path:
        """Standard format: a peft adapter folder (LoRA) or a full model folder, + tokenizer."""
        loaded = self.model_of[agent]
        directory = Path(directory)
        if loaded.mode == "full":
            target = directory / agent
            loaded.model.save_pretrained(target)
        else:
            # peft writes non-"default" adapters into <directory>/<adapter name>/
            loaded.model.save_pretrained(directory, selected_adapters=[loaded.adapter[agent]])
            target = directory / loaded.adapter[agent]
        loaded.tokenizer.save_pretrained(target)
        return target


def completion_inputs(
    batch: LogprobInputs, prompt_mask: torch.Tensor, kind: str, inputs: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The forward arguments of the completions run on their prompts' cache (``kind``:
    ``input_ids`` or ``inputs_embeds``): the prompt's mask, then the completion's."""
    row_prompt_mask = prompt_mask[batch.rows]
    width = batch.targets.shape[1]
    return {
        kind: inputs,
        "attention_mask": torch.cat([row_prompt_mask, batch.mask.to(prompt_mask.dtype)], dim=1),
        "position_ids": row_prompt_mask.sum(-1, keepdim=True)
        + torch.arange(width, device=prompt_mask.device)[None, :],
        "use_cache": True,
    }
