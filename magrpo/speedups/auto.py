"""``--speedups auto``: every technique of this package, where it applies.

Each technique decides for itself whether it applies (a Llama/Qwen2 model on CPU, oneDNN
present, a dtype it supports...) and otherwise leaves transformers' path in place, so
``auto`` is right on any machine. The memory options (activation checkpointing, sampled
states, the optimizer in backward) are off unless the config asks for them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from magrpo.config import ConfigError
from magrpo.forwards import last_position_pass, output_cache, position_ids, static_cache_forward
from magrpo.losses import token_logprobs
from magrpo.policies import Decoding, LoadedModel, LogprobBatch, LogprobInputs, completion_inputs
from magrpo.rollout import Completion
from magrpo.speedups import Speedups
from magrpo.speedups.activation_checkpointing import (
    CheckpointingUnsupported,
    checkpointed_layers,
    decoder_layers,
)
from magrpo.speedups.chunked_logprobs import linear_token_logprobs
from magrpo.speedups.grouped_attention import use_grouped_attention
from magrpo.speedups.heap import keep_freed_memory, release_free_heap
from magrpo.speedups.interleaved_passes import forwards_in_turn, new_cache
from magrpo.speedups.llama_decode import (
    LlamaDecodeStep,
    llama_decode_supported,
    separate_weights,
)
from magrpo.speedups.onednn import onednn_linears
from magrpo.speedups.optimizer_in_backward import BackwardSteps
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


class AutoSpeedups(Speedups):
    """The speed-ups, each where it applies, and the memory options the config turns on.

    ``side_by_side``: separate CPU models decode at the same time, each on its share of
    the threads (``threads``). ``gradient_checkpointing``: the log-prob pass keeps only each
    decoder layer's input (``activation_checkpointing``). ``reuse_sampled_states``: the
    update starts from the layer inputs that sampling computed (``sampled_states``).
    ``optimizer_in_backward``: each weight is stepped as soon as its gradient is complete
    (``optimizer_in_backward``; the log-prob pass's two forwards then run layer by layer in
    turn, ``interleaved_passes``). ``cpu_heap``: keep freed memory for the next step, or
    release it between phases (``heap``).
    """

    mode = "auto"

    def __init__(
        self,
        side_by_side: bool = True,
        gradient_checkpointing: bool = False,
        reuse_sampled_states: bool = False,
        optimizer_in_backward: bool = False,
        cpu_heap: str = "auto",
    ):
        self.side_by_side = side_by_side
        self.gradient_checkpointing = gradient_checkpointing
        self.reuse_sampled_states = reuse_sampled_states
        self.optimizer_in_backward = optimizer_in_backward
        self.cpu_heap = cpu_heap
        # the weights give their memory to their packed decode copies (``LlamaDecodeStep``)
        self.reuse_weight_memory = False
        # the log-prob pass's two forwards layer by layer in turn (``interleaved_passes``)
        self.passes_in_turn = False
        # while set, sampling records every layer's input for the log-prob pass to start
        # from (``sampled_states``); only valid until the weights change
        self.sampled_states: StateStore | None = None
        self.saving_memory = False  # set by prepare_run
        self._records: dict[int, dict[str, torch.Tensor]] = {}
        self._splits: dict[int, tuple[torch.nn.Module, torch.nn.Linear | None]] = {}
        self._unrecorded: list[LoadedModel] = []  # models already warned about
        self._backward_steps: dict[str, BackwardSteps] = {}

    @classmethod
    def from_config(cls, config: Any) -> AutoSpeedups:
        return cls(
            side_by_side=config.sample_side_by_side,
            gradient_checkpointing=config.gradient_checkpointing,
            reuse_sampled_states=config.reuse_sampled_states,
            optimizer_in_backward=config.optimizer_in_backward,
            cpu_heap=config.cpu_heap,
        )

    # --- setup ---------------------------------------------------------------------------
    def check_config(self, config: Any, world_size: int = 1, scales_loss: bool = False) -> None:
        if not self.optimizer_in_backward:
            return
        if world_size > 1:
            raise ConfigError(
                f"optimizer_in_backward steps each weight inside the backward, before the "
                f"{world_size} processes could sum its gradient: turn it off for data-parallel "
                "training (or train in one process)."
            )
        if scales_loss:
            raise ConfigError(
                "optimizer_in_backward steps each weight with the gradient as backward "
                "makes it, but accelerate's float16 mixed precision scales the loss and "
                "unscales the gradients only before a whole-model step: launch without "
                "--mixed_precision fp16, or turn optimizer_in_backward off."
            )

    def prepare_model(self, model: Any) -> None:
        use_grouped_attention(model)

    def prepare_run(self, policies: Any, optimizers: dict[str, Any]) -> None:
        self.saving_memory = (
            self.gradient_checkpointing or self.reuse_sampled_states or self.optimizer_in_backward
        )
        if self.saving_memory:
            # sampling too: the weights give their memory to their packed decode copies
            # (CPU: the fused decode step that packs them runs there only)
            for loaded in policies.models:
                if loaded.device.type == "cpu":
                    separate_weights(loaded.model)
            self.reuse_weight_memory = True
        if self.gradient_checkpointing:
            for loaded in policies.models:
                try:
                    decoder_layers(loaded.model)
                except CheckpointingUnsupported as error:
                    raise ConfigError(str(error)) from None
        if self.optimizer_in_backward:
            self._backward_steps = {
                agent: BackwardSteps(getattr(optimizer, "optimizer", optimizer))
                for agent, optimizer in optimizers.items()
            }
            # each layer's gradients complete (and are stepped and freed) in turn
            self.passes_in_turn = True
        if keeps_freed_memory(self.cpu_heap, policies, self.saving_memory):
            keep_freed_memory()  # after loading: the load's temporaries still go back

    # --- the training loop's points -----------------------------------------------------
    def rollout_started(self) -> None:
        self.sampled_states = StateStore() if self.reuse_sampled_states else None

    def weights_changed(self) -> None:
        self.sampled_states = None

    def before_pass(self) -> None:
        """When the run saves memory, the heap's free pages go back to the OS before each
        log-prob pass and each backward: freed memory that glibc keeps (sampling's packed
        copies, the forward's temporaries) would otherwise stay resident under the next
        phase's new allocations (0.1-0.25 GiB of the peak, ``benchmarks/profile_step.py``). A
        no-op when the process keeps its freed memory."""
        if self.saving_memory:
            release_free_heap()

    def backward(self, agents: Sequence[str], last: bool) -> AbstractContextManager:
        """With the optimizer in backward, a model's last backward steps its weights."""
        stack = contextlib.ExitStack()
        if last:
            for agent in agents:
                if agent in self._backward_steps:
                    stack.enter_context(self._backward_steps[agent].armed())
        return stack

    # --- sampling ------------------------------------------------------------------------
    def run_samplers(self, jobs: Sequence[Callable[[], Any]], seeded: bool) -> list[Any]:
        """Separate models decode side by side on CPU, each on its share of the threads:
        one model's small operators then overlap another's bandwidth-bound products. Only
        with per-row seeds: draws from torch's global generator would depend on the
        interleaving. Each model is prepared (prefill, packed weights) in this thread, so
        the large allocations stay in the heap that the update reuses (``heap``)."""
        if not (self.side_by_side and len(jobs) > 1 and seeded):
            outputs = []
            for job in jobs:  # one model at a time: only one holds its decoding state
                with job() as loop:
                    outputs.append(loop())
                del loop  # it holds the model's decoding state: gone before the next packs
            return outputs
        with contextlib.ExitStack() as stack:
            loops = [stack.enter_context(job()) for job in jobs]
            return run_side_by_side(loops)

    def split(self, loaded: LoadedModel, model) -> tuple[torch.nn.Module, torch.nn.Linear | None]:
        """(decoder, output layer) of ``model`` when its logits are exactly
        ``lm_head(decoder(...))``, else (model, None): checked once per model by a probe, so
        models that scale or soft-cap their logits keep the plain forward."""
        key = id(model)
        if key not in self._splits:
            self._splits[key] = _head_split(model, loaded.device) or (model, None)
        return self._splits[key]

    @contextlib.contextmanager
    def decoding(self, policies: Any, loaded: LoadedModel, batch: Any) -> Iterator[Decoding]:
        """The decode forward is :class:`LlamaDecodeStep` where it applies (Llama on CPU:
        fused products; each prompt's keys/values attended once for its G rows). Else it is
        transformers' forward on the static cache, with the weights packed for oneDNN
        (1.6-3.8x faster products at a decode step's few rows on CPU; ``onednn``).

        With ``sampled_states`` set and the fused step, every layer's inputs are recorded:
        ``"prefix"`` [layers, prompts, width - 1, hidden] for the prefill and ``"steps"``
        [layers, rows, max_new_tokens, hidden] for the decode steps (``sampled``)."""
        network, head = self.split(loaded, loaded.model)
        num_samples, width = batch.num_samples, batch.width
        positions = position_ids(batch.mask[:, :width])
        step_ids = batch.input_ids.repeat_interleave(num_samples, dim=0)
        prefix_mask = batch.attention_mask[:, :-1]
        fused = width > 1 and llama_decode_supported(network, head, prefix_mask, loaded.router)
        recording = fused and self.sampled_states is not None
        record: dict[str, torch.Tensor] = {}
        prefix = None
        # the fused step packs its own (concatenated) weights; the prefill's many rows run
        # as fast on the plain ones
        with onednn_linears(loaded.model, pack_rows=None if fused else len(step_ids)):
            if width > 1 and (num_samples > 1 or fused):
                with (
                    loaded.routed(batch.agents),
                    recorded_layer_inputs(network.layers if recording else []) as inputs,
                ):
                    output = last_position_pass(
                        network, head, batch.input_ids[:, :-1], prefix_mask
                    )
                if recording:
                    record["prefix"] = torch.stack(inputs)
                prefix = output_cache(output)
                del output
                step_ids, positions = step_ids[:, -1:], positions[:, -1:]
            with loaded.routed(batch.row_agents):
                if fused:
                    step = LlamaDecodeStep(
                        network,
                        head,
                        prefix,
                        prefix_mask,
                        num_samples,
                        batch.max_new_tokens,
                        loaded.router,
                        [loaded.adapter[a] for a in batch.row_agents],
                        reuse_weight_memory=self.reuse_weight_memory,
                        record_inputs=recording,
                    )
                    forward = step.step
                    if recording:
                        record["steps"] = step.inputs
                        self._records[id(loaded)] = record
                else:
                    forward = static_cache_forward(
                        loaded, network, head, batch.mask, prefix, num_samples
                    )
                del prefix  # the static cache holds copies; the fused step, the tensors
                try:
                    yield Decoding(forward, step_ids, positions)
                finally:
                    if fused:
                        step.restore_weights()

    def sampled(
        self, loaded: LoadedModel, completions: Sequence[Completion], prompts: Sequence[Any]
    ) -> None:
        """Keep each completion's recorded layer inputs for the update (``sampled_states``)."""
        record = self._records.pop(id(loaded), None)
        if record is None or self.sampled_states is None:
            return
        num_samples = len(completions) // len(prompts)
        for k, completion in enumerate(completions):
            row = k // num_samples
            prefix = record["prefix"][:, row]
            self.sampled_states.add(
                completion,
                SampledStates(
                    prefix[:, len(prefix[0]) - (len(prompts[row]) - 1) :],
                    record["steps"][:, k, : len(completion.completion_ids)],
                ),
            )

    # --- log-probs -----------------------------------------------------------------------
    def logprobs(
        self, policies: Any, batch: LogprobInputs, reference: bool, temperature: float
    ) -> LogprobBatch:
        """The log-prob pass, leaner and faster. The output layer runs only on the
        completions' real tokens, in chunks (``chunked_logprobs``), when the model's logits
        are plain ``lm_head(decoder(...))``. On CPU the linear layers run through oneDNN,
        forward and backward (``onednn``), and SwiGLU MLPs keep two tensors for backward
        instead of three (``swiglu``). With ``passes_in_turn`` (set for the optimizer in
        backward) the prompts' and the completions' forwards run layer by layer in turn
        (``interleaved_passes``); with sampled states, the pass starts from them."""
        loaded = batch.loaded
        if self.sampled_states is not None and not reference and torch.is_grad_enabled():
            states = self.sampled_states.find(batch.completions)
            if states is not None:
                return self._logprobs_from_states(batch, states, temperature)
            if loaded not in self._unrecorded:
                self._unrecorded.append(loaded)
                logger.warning(
                    "reuse_sampled_states: sampling recorded no layer inputs for agent(s) %s "
                    "(recording needs a Llama or Qwen2 model sampled by the fused CPU decode "
                    "step, in float32 or in bfloat16 on a CPU with oneDNN bfloat16 support); "
                    "their update runs the ordinary log-prob pass",
                    ", ".join(loaded.agents),
                )
        grad = torch.no_grad() if reference else contextlib.nullcontext()
        with grad, loaded.policy(reference) as model:
            network, head = self.split(loaded, model)
            prompt_ids, prompt_mask, _ = loaded.pad_batch([list(p) for _, p in batch.unique])
            embedding = network.get_input_embeddings()
            tied = tied_gradient(embedding, head)
            prompt_embeds, target_embeds = _embed_together(
                embedding, prompt_ids, batch.targets, tied
            )
            prompts = dict(
                inputs_embeds=prompt_embeds,
                attention_mask=prompt_mask,
                position_ids=position_ids(prompt_mask),
                use_cache=True,
            )
            completions = completion_inputs(batch, prompt_mask, "inputs_embeds", target_embeds)
            cache = (
                new_cache(network)
                if self.passes_in_turn and head is not None and torch.is_grad_enabled()
                else None
            )
            if cache is not None:

                def layer_pass(index: int, layer: torch.nn.Module, of_prompts: bool):
                    passing = batch.prompt_agents if of_prompts else batch.agents
                    return self._logprob_pass(loaded, layer, passing, reference, index)

                prompt_hidden, hidden = forwards_in_turn(
                    network,
                    cache,
                    loaded.cache_kwarg,
                    prompts,
                    completions,
                    batch.rows,
                    layer_pass,
                )
            else:
                with self._logprob_pass(loaded, model, batch.prompt_agents, reference):
                    only_last = {"logits_to_keep": 1} if head is None else {}
                    prompt_out = network(**prompts, **only_last)
                cache = output_cache(prompt_out)
                cache.reorder_cache(batch.rows)  # differentiable, shares the prompt pass
                with self._logprob_pass(loaded, model, batch.agents, reference):
                    output = network(**completions, **{loaded.cache_kwarg: cache})
                if head is None:
                    logits = torch.cat(
                        [prompt_out.logits[batch.rows, -1:], output.logits[:, :-1]], dim=1
                    )
                    return LogprobBatch(
                        token_logprobs(logits / temperature, batch.targets), batch.mask
                    )
                prompt_hidden, hidden = prompt_out.last_hidden_state, output.last_hidden_state
            hidden = torch.cat([prompt_hidden[batch.rows, -1:], hidden[:, :-1]], dim=1)
            return LogprobBatch(
                _head_logprobs(hidden, head, batch.targets, batch.mask, tied, temperature),
                batch.mask,
            )

    def _logprobs_from_states(
        self, batch: LogprobInputs, states: Sequence[SampledStates], temperature: float
    ) -> LogprobBatch:
        """The log-probs from the layer inputs that sampling recorded (``sampled_states``):
        the sequence as the decode loop ran it, each prompt minus its last token once, then
        per completion its prompt's last token and its tokens but the last."""
        loaded, targets, mask = batch.loaded, batch.targets, batch.mask
        network, head = self.split(loaded, loaded.model)
        first = {key: index for index, key in reversed(list(enumerate(batch.keys)))}
        prompt_ids, prompt_mask, width = loaded.pad_batch([list(p[:-1]) for _, p in batch.unique])
        last_tokens = torch.tensor([p[-1] for _, p in batch.unique], device=targets.device)
        step_ids = torch.cat([last_tokens[batch.rows, None], targets[:, :-1]], dim=1)
        embedding = network.get_input_embeddings()
        tied = tied_gradient(embedding, head)
        prompt_embeds, step_embeds = _embed_together(embedding, prompt_ids, step_ids, tied)
        hidden = final_hidden_from_states(
            network,
            loaded.cache_kwarg,
            dict(
                inputs_embeds=prompt_embeds,
                attention_mask=prompt_mask,
                position_ids=position_ids(prompt_mask),
                use_cache=True,
            ),
            completion_inputs(batch, prompt_mask, "inputs_embeds", step_embeds),
            pad_states(
                [states[first[key]].prefix for key in batch.unique], width, True, prompt_embeds
            ),
            pad_states([s.steps for s in states], targets.shape[1], False, prompt_embeds),
            batch.rows,
            lambda index, layer, of_prompts: self._forwards(
                loaded, layer, batch.prompt_agents if of_prompts else batch.agents, False
            ),
        )
        return LogprobBatch(_head_logprobs(hidden, head, targets, mask, tied, temperature), mask)

    @contextlib.contextmanager
    def _forwards(
        self, loaded: LoadedModel, module: torch.nn.Module, agents: Sequence[str], reference: bool
    ) -> Iterator[None]:
        """The blocks ``module``'s forwards run in: rows routed to ``agents``' adapters,
        linears through oneDNN, lean SwiGLU MLPs."""
        with loaded.routed(agents, reference), onednn_linears(module), lean_swiglu(module):
            yield

    @contextlib.contextmanager
    def _logprob_pass(
        self,
        loaded: LoadedModel,
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
            return self._forwards(loaded, module, agents, reference)

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


def keeps_freed_memory(policy: str, policies: Any, saving_memory: bool = False) -> bool:
    """``cpu_heap``: "auto" keeps freed memory when a CPU model is fully fine-tuned, whose
    gradients and packed weights are re-allocated every step (see ``heap``), unless the run
    trades time for memory (``saving_memory``: gradient checkpointing or the optimizer in
    backward), whose savings a kept heap would hide: it grows to the high-water mark of its
    fragmented free space (4.9 GiB instead of 4.4, ``benchmarks/profile_step.py``)."""
    on_cpu = [loaded for loaded in policies.models if loaded.device.type == "cpu"]
    if policy == "auto":
        return not saving_memory and any(loaded.mode == "full" for loaded in on_cpu)
    return policy == "keep" and bool(on_cpu)


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
    gradient takes the lookup's rows instead (``tied_weights``)."""
    ids = torch.cat([prompt_ids.reshape(-1), target_ids.reshape(-1)])
    looked_up = embedding(ids) if tied is None else tied_lookup(embedding, ids, tied)
    prompts, targets = looked_up.split([prompt_ids.numel(), target_ids.numel()])
    return prompts.view(*prompt_ids.shape, -1), targets.view(*target_ids.shape, -1)


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
