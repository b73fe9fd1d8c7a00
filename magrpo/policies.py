"""The N agent policies: sampling and batched, mask-aware token log-probabilities.

Default (``finetune="lora"``, one model): one frozen base model shared by every agent, one
LoRA adapter per agent (peft named adapters). A batch may mix agents: peft's
``adapter_names=`` routes each row through its own adapter, so the G samples of *all*
agents come from one ``generate`` call and their log-probs from one forward pass. Memory is
about one model. ``finetune="full"`` or a list of models gives one model per agent
(heterogeneous models and tokenizers are fine); batches are then per agent.

Log-probs: each distinct prompt runs once (left-padded); its KV cache is shared by the
completions sampled from it, which run right-padded on top. A completion's extent comes
from its length (tokens up to and including its first EOS), never from searching pad ids
(SmolLM2's pad == eos == <|im_end|>, which also occurs in prompts).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StaticCache

from magrpo.lora_routing import AdapterRouter
from magrpo.losses import (
    completion_length,
    completion_mask,
    linear_token_logprobs,
    token_logprobs,
)
from magrpo.rollout import Completion, derive_seed
from magrpo.sampling import row_generators, sample_tokens
from magrpo.speedups.activation_checkpointing import checkpointed_layers, decoder_layers
from magrpo.speedups.grouped_attention import use_grouped_attention
from magrpo.speedups.interleaved_passes import forwards_in_turn, new_cache
from magrpo.speedups.llama_decode import LlamaDecodeStep, llama_decode_supported
from magrpo.speedups.onednn import onednn_linears
from magrpo.speedups.sampled_states import (
    SampledStates,
    StateStore,
    final_hidden_from_states,
    pad_states,
    recorded_layer_inputs,
)
from magrpo.speedups.swiglu import lean_swiglu
from magrpo.speedups.threads import run_side_by_side
from magrpo.speedups.tied_weights import TiedGradient, tied_gradient, tied_lookup

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
    #: Per agent: strings after which an answer is complete (an env's ``answer_format``).
    #: The answer ends with the token that completes one; what follows is never generated.
    stop: Mapping[str, Sequence[str]] = field(default_factory=dict)


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
        self._splits: dict[int, tuple[torch.nn.Module, torch.nn.Linear | None]] = {}
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

    def split(self, model) -> tuple[torch.nn.Module, torch.nn.Linear | None]:
        """(decoder, output layer) of ``model`` when its logits are exactly
        ``lm_head(decoder(...))``, else (model, None): checked once per model by a probe, so
        models that scale or soft-cap their logits keep the plain forward."""
        key = id(model)
        if key not in self._splits:
            self._splits[key] = _head_split(model, self.device) or (model, None)
        return self._splits[key]

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


def completion_from_ids(
    agent: str,
    prompt_ids: list[int],
    ids: Sequence[int],
    eos_ids: Sequence[int],
    tokenizer,
    stop: Sequence[str] = (),
) -> Completion:
    """Generated ids as a Completion: cut after the first EOS (padding and anything a batch
    kept generating dropped) or after the token that completes a ``stop`` string, whichever
    comes first; ``finished`` when it ended either way; text without specials.

    Every generation path ends here, so the tokens trained on are exactly the answer's,
    whether or not the sampler itself stopped at the string."""
    ids = [int(token) for token in ids]
    kept = ids[: completion_length(ids, eos_ids)]
    finished = bool(kept) and kept[-1] in eos_ids
    text = tokenizer.decode(kept, skip_special_tokens=True)
    if stop and any(s in text for s in stop):
        kept = kept[: _stop_length(kept, stop, tokenizer)]
        text = tokenizer.decode(kept, skip_special_tokens=True)
        finished = True
    return Completion(agent, text, list(prompt_ids), kept, finished)


def _stop_length(ids: list[int], stop: Sequence[str], tokenizer) -> int:
    """The fewest leading tokens of ``ids`` whose text contains a stop string (there is one:
    containing it only grows with the prefix, so a binary search finds the first)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        text = tokenizer.decode(ids[:middle], skip_special_tokens=True)
        if any(s in text for s in stop):
            high = middle
        else:
            low = middle + 1
    return low


def _ends_an_answer(ids: list[int], stop: Sequence[str], tokenizer) -> bool:
    """Whether the newest token completed a stop string: checked on the last tokens only
    (a string of n characters lies within the last n + 1 tokens that completed it)."""
    window = max(len(s) for s in stop) + 1
    text = tokenizer.decode(ids[-window:], skip_special_tokens=True)
    return any(s in text for s in stop)


def _adapter_name(agent: str) -> str:
    return re.sub(r"\W", "_", agent) or "agent"


def _is_adapter_parameter(name: str, adapter: str) -> bool:
    """``...q_proj.lora_A.<adapter>.weight``: matched by path component, not substring (an
    agent named ``model`` must not take ``base_model.model.*`` of every adapter)."""
    parts = name.split(".")
    return any(
        part.startswith("lora_") and following == adapter
        for part, following in zip(parts, parts[1:], strict=False)
    )


def _check_chat_template(backend: _Backend) -> None:
    """A chat template exists, and the token that ends an assistant turn stops generation.

    Without the second, a model whose template ends turns with a token that is not one of
    its EOS tokens would write past the end of every answer until ``max_new_tokens``.
    """
    tokenizer = backend.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(
            f"The tokenizer of agents {', '.join(backend.agents)} has no chat template, but "
            "use_chat_template is on. Pass --no-use-chat-template to give the model raw text "
            "prompts (as the paper does with base models), or use a model with a chat template."
        )
    marker = "\u2045answer\u2046"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}],
        tokenize=False,
    )
    after = text.split(marker, 1)[1].lstrip() if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    if ids and ids[0] not in backend.eos_ids:
        logger.warning(
            "The chat template of agents %s ends a turn with %r, which is not an EOS token of "
            "the model; it is added to the tokens that end an answer.",
            ", ".join(backend.agents), tokenizer.convert_ids_to_tokens(ids[0]),
        )
        backend.eos_ids = sorted({*backend.eos_ids, ids[0]})


def _output_cache(output):
    """The KV cache of a forward output (``cache`` in transformers >= 5.2x, else the old name)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


class Policies:
    """The agents' policies. Build with :func:`load_policies` (or directly from models)."""

    def __init__(
        self, backends: list[_Backend], use_chat_template: bool = True, side_by_side: bool = True
    ):
        self.backends = backends
        self.use_chat_template = use_chat_template
        if use_chat_template:
            for backend in backends:
                _check_chat_template(backend)
        self.side_by_side = side_by_side  # seeded sampling of separate CPU models (``sample``)
        self.gradient_checkpointing = False  # in the log-prob pass (``activation_checkpointing``)
        # the log-prob pass's two forwards layer by layer in turn (``interleaved_passes``)
        self.passes_in_turn = False
        # the weights give their memory to their packed decode copies (``LlamaDecodeStep``)
        self.lend_decode_weights = False
        # while set, sampling records every layer's input for the log-prob pass to start from
        # (``sampled_states``); only valid until the weights change
        self.sampled_states: StateStore | None = None
        self._unrecorded: list[_Backend] = []  # models already warned about
        self.backend_of = {agent: b for b in backends for agent in b.agents}
        self.agents = [agent for b in backends for agent in b.agents]

    # --- text <-> tokens -----------------------------------------------------------------
    def encode_prompt(self, agent: str, observation: str) -> list[int]:
        tokenizer = self.backend_of[agent].tokenizer
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
        alone, not of the batch it shares; None draws from torch's global generator. With
        seeds, separate models on the CPU decode side by side if ``side_by_side`` (every
        model's decoding state, e.g. its packed weights, is then held at once).
        """
        results: list[list[Completion]] = [[] for _ in requests]
        calls = []  # (backend, rows, agents, prompts, seeds): one per model
        for backend in self.backends:
            rows = [i for i, (agent, _) in enumerate(requests) if agent in backend.adapter]
            if not rows:
                continue
            sample_seeds = (
                None
                if seeds is None
                else [derive_seed(seeds[i], g) for i in rows for g in range(num_samples)]
            )
            agents = [requests[i][0] for i in rows]
            prompts = [self.encode_prompt(*requests[i]) for i in rows]
            calls.append((backend, rows, agents, prompts, sample_seeds, {}))
        # Models decode side by side on CPU, each on its share of the threads: one model's
        # small operators then overlap another's bandwidth-bound products. Only with
        # per-row seeds: draws from torch's global generator would depend on the interleaving.
        # Each model is prepared (prefill, packed weights) in this thread, so the large
        # allocations stay in the heap that the update reuses (``heap``).
        cpu = all(b.device.type == "cpu" for b, *_ in calls)
        if self.side_by_side and len(calls) > 1 and seeds is not None and cpu:
            with contextlib.ExitStack() as stack:
                loops = [
                    stack.enter_context(
                        self._generation(backend, a, p, num_samples, params, s, record)
                    )
                    for backend, _, a, p, s, record in calls
                ]
                outputs = run_side_by_side(loops)
        else:  # one model at a time: only one holds its decoding state
            outputs = []
            for backend, _, a, p, s, record in calls:
                with self._generation(backend, a, p, num_samples, params, s, record) as loop:
                    outputs.append(loop())
                del loop  # it holds the model's decoding state: gone before the next packs
        for (backend, rows, agents, prompts, _, record), generated in zip(
            calls, outputs, strict=True
        ):
            for k, completion_ids in enumerate(generated):
                row = k // num_samples
                completion = completion_from_ids(
                    agents[row],
                    prompts[row],
                    completion_ids,
                    backend.eos_ids,
                    backend.tokenizer,
                    params.stop.get(agents[row], ()),
                )
                results[rows[row]].append(completion)
                if record and self.sampled_states is not None:
                    prefix = record["prefix"][:, row]
                    self.sampled_states.add(
                        completion,
                        SampledStates(
                            prefix[:, len(prefix[0]) - (len(prompts[row]) - 1) :],
                            record["steps"][:, k, : len(completion.completion_ids)],
                        ),
                    )
        return results

    @contextlib.contextmanager
    def _generation(
        self,
        backend: _Backend,
        agents: list[str],
        prompts: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        sample_seeds: Sequence[int] | None = None,
        record: dict[str, torch.Tensor] | None = None,
    ) -> Iterator[Callable[[], list[list[int]]]]:
        """Prepares sampling ``num_samples`` continuations of each prompt and yields the
        decode loop, which returns their token ids, rows grouped by prompt. Call it within
        the block, from any thread.

        The G samples of a prompt share its prefill: the prompt minus its last token is run
        once. Decoding is our own loop rather than ``generate``: a forward, our sampler, and
        the EOS bookkeeping per token, without generate's per-step processors, stopping
        criteria and input preparation. The forward of a step is :class:`LlamaDecodeStep`
        where it applies (Llama on CPU: fused oneDNN products; each prompt's keys/values
        attended once for its G rows). Else it is transformers' forward on a pre-allocated
        (static) cache that starts with G copies of the prefill and where each new token's
        keys/values are written in place, with the weights packed for oneDNN (1.6-3.8x
        faster products at a decode step's few rows on CPU; ``onednn``).

        ``record`` (with ``sampled_states`` set, and the fused step): filled with every
        layer's inputs, ``"prefix"`` [layers, prompts, width - 1, hidden] for the prefill
        and ``"steps"`` [layers, rows, max_new_tokens, hidden] for the decode steps.
        """
        with torch.inference_mode():
            input_ids, attention_mask, width = backend.pad_batch(prompts)
            rows = len(prompts) * num_samples
            row_agents = [a for a in agents for _ in range(num_samples)]
            network, head = backend.split(backend.model)
            mask = torch.ones(
                rows, width + params.max_new_tokens, dtype=torch.long, device=input_ids.device
            )
            mask[:, :width] = attention_mask.repeat_interleave(num_samples, dim=0)
            positions = _position_ids(mask[:, :width])
            step_ids = input_ids.repeat_interleave(num_samples, dim=0)
            prefix_mask = attention_mask[:, :-1]
            fused = width > 1 and llama_decode_supported(network, head, prefix_mask, backend.router)
            prefix = None
            recording = record is not None and fused and self.sampled_states is not None
            # the fused step packs its own (concatenated) weights; the prefill's many rows run
            # as fast on the plain ones
            with onednn_linears(backend.model, pack_rows=None if fused else rows):
                if width > 1 and (num_samples > 1 or fused):
                    with (
                        backend.routed(agents),
                        recorded_layer_inputs(network.layers if recording else []) as inputs,
                    ):
                        output = _last_position_pass(network, head, input_ids[:, :-1], prefix_mask)
                    if recording:
                        record["prefix"] = torch.stack(inputs)
                    prefix = _output_cache(output)
                    del output
                    step_ids, positions = step_ids[:, -1:], positions[:, -1:]
                with backend.routed(row_agents):
                    if fused:
                        step = LlamaDecodeStep(
                            network,
                            head,
                            prefix,
                            prefix_mask,
                            num_samples,
                            params.max_new_tokens,
                            backend.router,
                            [backend.adapter[a] for a in row_agents],
                            lend_weights=self.lend_decode_weights,
                            record_inputs=recording,
                        )
                        forward = step.step
                        if recording:
                            record["steps"] = step.inputs
                    else:
                        forward = _static_cache_forward(
                            backend, network, head, mask, prefix, num_samples
                        )
                    del prefix  # the static cache holds copies; the fused step, the tensors
                    stops = [tuple(params.stop.get(a, ())) for a in row_agents]
                    loop = functools.partial(
                        self._decode,
                        backend,
                        forward,
                        step_ids,
                        positions,
                        params,
                        sample_seeds,
                        stops,
                    )
                    try:
                        yield loop
                    finally:
                        if fused:
                            step.give_back()

    @torch.inference_mode()
    def _decode(self, backend, forward, step_ids, positions, params, sample_seeds, stops):
        """The sampling loop: ``forward(ids, positions)`` gives the next-token logits. A row
        ends at an EOS token or at the token that completes one of its ``stops``."""
        rows = len(step_ids)
        generators = None
        if params.temperature > 0 and sample_seeds is not None:
            generators = row_generators(sample_seeds, backend.device)
        eos = torch.tensor(backend.eos_ids, device=step_ids.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=step_ids.device)
        tokens = []
        for _ in range(params.max_new_tokens):
            logits = forward(step_ids, positions)
            if params.temperature > 0:
                next_ids = sample_tokens(
                    logits, params.temperature, params.top_p, params.top_k, generators
                )[:, 0]
            else:
                next_ids = logits.argmax(-1)
            next_ids = torch.where(finished, backend.pad_id, next_ids)
            tokens.append(next_ids)
            finished |= torch.isin(next_ids, eos)
            watched = [row for row in range(rows) if stops[row] and not finished[row]]
            if watched:
                generated = torch.stack(tokens, dim=1)[watched].tolist()
                for row, ids in zip(watched, generated, strict=True):
                    if _ends_an_answer(ids, stops[row], backend.tokenizer):
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

        Each distinct (agent, prompt) is run once; its KV cache (with gradients) is then
        indexed to the rows of its completions, which are run in one pass on top of it. The
        G samples of a group thus cost one prompt, not G. The output layer runs only on the
        completions' real tokens, in chunks (``linear_token_logprobs``), when the model's
        logits are plain ``lm_head(decoder(...))``. On CPU the linear layers run through
        oneDNN, forward and backward (``onednn``), and SwiGLU MLPs keep two tensors for
        backward instead of three (``swiglu``). With ``passes_in_turn`` (set for the
        optimizer in backward) the prompts' and the completions' forwards run layer by layer
        in turn (``interleaved_passes``). ``reference=True``: the reference policy (LoRA:
        the base, adapters off), without gradients.
        """
        backend = self.backend_of[completions[0].agent]
        agents = [c.agent for c in completions]
        if any(self.backend_of[a] is not backend for a in agents):
            raise ValueError("a log-prob batch must come from one model; see group_key()")
        keys = [(c.agent, tuple(c.prompt_ids)) for c in completions]
        unique = list(dict.fromkeys(keys))
        position = {key: i for i, key in enumerate(unique)}
        device = backend.device
        rows = torch.tensor([position[key] for key in keys], device=device)
        width = max(len(c.completion_ids) for c in completions)
        targets = torch.full((len(completions), width), backend.pad_id, dtype=torch.long)
        for row, completion in enumerate(completions):
            targets[row, : len(completion.completion_ids)] = torch.tensor(completion.completion_ids)
        targets = targets.to(device)
        lengths = torch.tensor([len(c.completion_ids) for c in completions], device=device)
        mask = completion_mask(targets, lengths)
        if self.sampled_states is not None and not reference and torch.is_grad_enabled():
            states = self.sampled_states.find(completions)
            if states is not None:
                return self._logprobs_from_states(
                    backend, completions, states, keys, rows, targets, mask, temperature
                )
            if backend not in self._unrecorded:
                self._unrecorded.append(backend)
                logger.warning(
                    "reuse_sampled_states: sampling recorded no layer inputs for agent(s) %s "
                    "(recording needs a Llama or Qwen2 model sampled by the fused CPU decode "
                    "step, in float32 or in bfloat16 on a CPU with oneDNN bfloat16 support); "
                    "their update runs the ordinary log-prob pass",
                    ", ".join(backend.agents),
                )
        grad = torch.no_grad() if reference else contextlib.nullcontext()
        with grad, self._reference_context(backend, reference) as model:
            network, head = backend.split(model)
            prompt_agents = [a for a, _ in unique]
            prompt_ids, prompt_mask, _ = backend.pad_batch([list(p) for _, p in unique])
            embedding = network.get_input_embeddings()
            tied = tied_gradient(embedding, head)
            prompt_embeds, target_embeds = _embed_together(embedding, prompt_ids, targets, tied)
            prompts = dict(
                inputs_embeds=prompt_embeds,
                attention_mask=prompt_mask,
                position_ids=_position_ids(prompt_mask),
                use_cache=True,
            )
            row_prompt_mask = prompt_mask[rows]
            completions = dict(
                inputs_embeds=target_embeds,
                attention_mask=torch.cat([row_prompt_mask, mask.to(prompt_mask.dtype)], dim=1),
                position_ids=row_prompt_mask.sum(-1, keepdim=True)
                + torch.arange(width, device=device)[None, :],
                use_cache=True,
            )
            cache = (
                new_cache(network)
                if self.passes_in_turn and head is not None and torch.is_grad_enabled()
                else None
            )
            if cache is not None:

                def layer_pass(index: int, layer: torch.nn.Module, of_prompts: bool):
                    passing = prompt_agents if of_prompts else agents
                    return self._logprob_pass(backend, layer, passing, reference, index)

                prompt_hidden, hidden = forwards_in_turn(
                    network, cache, backend.cache_kwarg, prompts, completions, rows, layer_pass
                )
            else:
                with self._logprob_pass(backend, model, prompt_agents, reference):
                    only_last = {"logits_to_keep": 1} if head is None else {}
                    prompt_out = network(**prompts, **only_last)
                cache = _output_cache(prompt_out)
                cache.reorder_cache(rows)  # index_select: differentiable, shares the prompt pass
                with self._logprob_pass(backend, model, agents, reference):
                    output = network(**completions, **{backend.cache_kwarg: cache})
                if head is None:
                    logits = torch.cat([prompt_out.logits[rows, -1:], output.logits[:, :-1]], dim=1)
                    return LogprobBatch(token_logprobs(logits / temperature, targets), mask)
                prompt_hidden, hidden = prompt_out.last_hidden_state, output.last_hidden_state
            hidden = torch.cat([prompt_hidden[rows, -1:], hidden[:, :-1]], dim=1)
            return LogprobBatch(
                _head_logprobs(hidden, head, targets, mask, tied, temperature), mask
            )

    def _logprobs_from_states(
        self,
        backend: _Backend,
        completions: Sequence[Completion],
        states: Sequence[SampledStates],
        keys: list[tuple[str, tuple[int, ...]]],
        rows: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        temperature: float,
    ) -> LogprobBatch:
        """``logprobs`` from the layer inputs that sampling recorded (``sampled_states``):
        the sequence as the decode loop ran it, each prompt minus its last token once, then
        per completion its prompt's last token and its tokens but the last."""
        network, head = backend.split(backend.model)
        unique = list(dict.fromkeys(keys))
        first = {key: index for index, key in reversed(list(enumerate(keys)))}
        prompt_agents = [agent for agent, _ in unique]
        agents = [c.agent for c in completions]
        prompt_ids, prompt_mask, width = backend.pad_batch([list(p[:-1]) for _, p in unique])
        last_tokens = torch.tensor([p[-1] for _, p in unique], device=targets.device)
        step_ids = torch.cat([last_tokens[rows, None], targets[:, :-1]], dim=1)
        embedding = network.get_input_embeddings()
        tied = tied_gradient(embedding, head)
        prompt_embeds, step_embeds = _embed_together(embedding, prompt_ids, step_ids, tied)
        row_prompt_mask = prompt_mask[rows]
        hidden = final_hidden_from_states(
            network,
            backend.cache_kwarg,
            dict(
                inputs_embeds=prompt_embeds,
                attention_mask=prompt_mask,
                position_ids=_position_ids(prompt_mask),
                use_cache=True,
            ),
            dict(
                inputs_embeds=step_embeds,
                attention_mask=torch.cat([row_prompt_mask, mask.to(prompt_mask.dtype)], dim=1),
                position_ids=row_prompt_mask.sum(-1, keepdim=True)
                + torch.arange(targets.shape[1], device=targets.device)[None, :],
                use_cache=True,
            ),
            pad_states([states[first[key]].prefix for key in unique], width, True, prompt_embeds),
            pad_states([s.steps for s in states], targets.shape[1], False, prompt_embeds),
            rows,
            lambda index, layer, of_prompts: self._forwards(
                backend, layer, prompt_agents if of_prompts else agents, False
            ),
        )
        return LogprobBatch(_head_logprobs(hidden, head, targets, mask, tied, temperature), mask)

    @contextlib.contextmanager
    def _forwards(
        self, backend: _Backend, module: torch.nn.Module, agents: Sequence[str], reference: bool
    ) -> Iterator[None]:
        """The blocks ``module``'s forwards run in: rows routed to ``agents``' adapters,
        linears through oneDNN, lean SwiGLU MLPs."""
        with backend.routed(agents, reference), onednn_linears(module), lean_swiglu(module):
            yield

    @contextlib.contextmanager
    def _logprob_pass(
        self,
        backend: _Backend,
        module: torch.nn.Module,
        agents: Sequence[str],
        reference: bool,
        layer_index: int | None = None,
    ) -> Iterator[None]:
        """The blocks one forward of the log-prob pass runs in, for the whole model
        (``module``) or for its decoder layer number ``layer_index`` alone: ``_forwards``;
        and, with ``gradient_checkpointing``, its decoder layers checkpointed (a replayed
        layer enters the same blocks again, as they have ended when the backward runs)."""

        def forwards(module: torch.nn.Module) -> AbstractContextManager[None]:
            return self._forwards(backend, module, agents, reference)

        with forwards(module):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                layers = (
                    dict(enumerate(decoder_layers(module)))
                    if layer_index is None
                    else {layer_index: module}
                )
                with checkpointed_layers(layers, forwards):
                    yield
            else:
                yield

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
            return {
                name: p
                for name, p in backend.model.named_parameters()
                if _is_adapter_parameter(name, backend.adapter[agent])
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


def _head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    mask: torch.Tensor,
    tied: TiedGradient | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[B, T] log-probs of ``targets`` under ``head(hidden) / temperature``, computed for the
    real tokens of ``mask`` only (0 elsewhere). Dividing the hidden states divides the
    logits (the head has no bias) before the chunked output layer ever makes them."""
    real = mask.bool()
    logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    states = hidden[real] if temperature == 1.0 else hidden[real] / temperature
    return logprobs.masked_scatter(
        real, linear_token_logprobs(states, head.weight, targets[real], tied)
    )


def _embed_together(
    embedding: torch.nn.Module,
    prompt_ids: torch.Tensor,
    target_ids: torch.Tensor,
    tied: TiedGradient | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embeddings of the prompts [P, Lp] and the completions [B, W], looked up in
    one call: when the embedding is trained (full fine-tuning), its backward then makes one
    dense [vocab, hidden] gradient instead of one per pass (113 MB each for SmolLM2 in
    float32, each zero-filled and then added to the other). ``tied``: the output layer's
    gradient takes the lookup's rows instead (``magrpo.speedups.tied_weights``)."""
    ids = torch.cat([prompt_ids.reshape(-1), target_ids.reshape(-1)])
    looked_up = embedding(ids) if tied is None else tied_lookup(embedding, ids, tied)
    prompts, targets = looked_up.split([prompt_ids.numel(), target_ids.numel()])
    return prompts.view(*prompt_ids.shape, -1), targets.view(*target_ids.shape, -1)


def _last_position_pass(network, head, inputs, attention_mask, position_ids=None, **cache):
    """A cached forward of which only the last position's output is used: left-padded
    prompts, or one decode step (``inputs``: token ids [B, L], or their embeddings
    [B, L, H]). When the network is the whole model (``head`` None), only that position's
    logits are computed."""
    return network(
        **{"input_ids" if inputs.dim() == 2 else "inputs_embeds": inputs},
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask) if position_ids is None else position_ids,
        use_cache=True,
        **({"logits_to_keep": 1} if head is None else {}),
        **cache,
    )


def _static_cache_forward(backend, network, head, mask, prefix, num_samples):
    """transformers' forward of a decode step, on a static cache that starts with G copies
    of the prefill (if any): ``forward(ids, positions)`` -> the last position's logits."""
    cache = StaticCache(config=backend.model.config, max_cache_len=mask.shape[1])
    cached = 0
    if prefix is not None:
        for static, prefilled in zip(cache.layers, prefix.layers, strict=True):
            static.update(
                prefilled.keys.repeat_interleave(num_samples, dim=0),
                prefilled.values.repeat_interleave(num_samples, dim=0),
            )
        cached = prefix.get_seq_length()

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        nonlocal cached
        cached += ids.shape[1]
        output = _last_position_pass(
            network, head, ids, mask[:, :cached], positions, **{backend.cache_kwarg: cache}
        )
        if head is None:
            return output.logits[:, -1]
        return head(output.last_hidden_state[:, -1])

    return forward


def _head_split(model, device) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if get_decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    decoder = get_decoder()
    if not isinstance(decoder, torch.nn.Module) or decoder is base:
        return None
    probe = (torch.arange(1, 6, device=device) % head.out_features)[None, :]
    with torch.no_grad():
        expected = model(input_ids=probe).logits.float()
        split = head(decoder(input_ids=probe).last_hidden_state).float()
    return (decoder, head) if torch.allclose(split, expected, rtol=1e-4, atol=1e-4) else None


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
    model = model.to(device)
    use_grouped_attention(model)
    return model, tokenizer


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
    agent_devices: Sequence[torch.device | str] | None = None,
) -> Policies:
    """Load the policies. ``model_paths``: one per agent (identical paths + LoRA: shared).

    ``agent_devices`` (one per agent) places separate models on separate devices, e.g. two
    7B agents on two GPUs; a shared base cannot be split, so it then needs one device.
    """
    from peft import get_peft_model

    agents = list(agents)
    if len(model_paths) != len(agents):
        raise ModelLoadError(
            f"Got {len(model_paths)} model(s) for {len(agents)} agents ({', '.join(agents)}): "
            "pass one --model for all agents or exactly one --models entry per agent."
        )
    devices = [torch.device(d) for d in (agent_devices or [device] * len(agents))]
    if len(devices) != len(agents):
        raise ModelLoadError(
            f"Got {len(devices)} device(s) for {len(agents)} agents ({', '.join(agents)}): "
            "--agent-devices needs exactly one device per agent, in that order."
        )
    torch_dtype = DTYPES[dtype]
    lora = _lora_config(lora_rank, lora_alpha, lora_target_modules)
    backends: list[_Backend] = []
    if finetune == "lora" and len(set(model_paths)) == 1:
        if len(set(devices)) > 1:
            raise ModelLoadError(
                f"--agent-devices {' '.join(map(str, devices))} puts agents on different "
                "devices, but with --finetune lora and one model every agent is an adapter on "
                "one shared base model, which lives on one device. Use --finetune full (or "
                "--models, one per agent) to give each agent its own model, or one device."
            )
        base, tokenizer = _load_model(model_paths[0], torch_dtype, devices[0])
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
        for agent, path, device in zip(agents, model_paths, devices, strict=True):
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
