"""VLLMSampler: clear errors where vLLM cannot run, its plumbing against a fake vLLM, a GPU run.

The fake ``vllm`` package below mimics the parts of the real API the sampler relies on (checked
against vLLM's source): ``SamplingParams`` validation (greedy needs n == 1, top_k 0 rejected as
in vLLM < 0.9), ``LoRARequest`` ids >= 1, ``generate`` with per-prompt lists, adapters loaded
from ``lora_path`` once per ``lora_int_id`` and cached, stop tokens kept in ``token_ids``. It
generates with the HF model + the saved peft adapter, so on CPU the sampler's greedy output must
equal ``Policies.sample``'s exactly. The real engine is exercised by the GPU test only.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from magrpo_fixtures import build_tiny_model, build_tokenizer, tiny_model_path  # noqa: F401

from magrpo import vllm_sampler
from magrpo.loading import load_policies
from magrpo.policies import SamplingParams
from magrpo.vllm_sampler import VLLMSampler, VLLMUnavailableError, completion_from_vllm

AGENTS = ["alice", "bob"]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
REQUESTS = [("alice", "say words"), ("bob", "say words"), ("alice", "task one two")]


def perturb_lora_b(policies, agent: str, std: float, seed: int) -> None:
    """Give an agent's adapter non-trivial weights (peft initialises lora_B to zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(policies.named_trainable_parameters(agent).items()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


@pytest.fixture
def policies(tiny_model_path):  # noqa: F811
    loaded = load_policies(AGENTS, [tiny_model_path] * 2)
    perturb_lora_b(loaded, "alice", 0.3, seed=1)
    perturb_lora_b(loaded, "bob", 0.3, seed=2)
    return loaded


def check_conventions(policies, requests, groups, num_samples, max_new_tokens) -> None:
    """The Completion contract of Policies.sample."""
    backend = policies.models[0]
    assert len(groups) == len(requests)
    for (agent, observation), group in zip(requests, groups, strict=True):
        assert len(group) == num_samples
        for completion in group:
            assert completion.agent == agent
            assert completion.prompt_ids == policies.encode_prompt(agent, observation)
            ids = completion.completion_ids
            assert 0 < len(ids) <= max_new_tokens
            eos_positions = [i for i, token in enumerate(ids) if token in backend.eos_ids]
            assert eos_positions in ([], [len(ids) - 1])  # at most one EOS, and last
            assert completion.finished == bool(eos_positions)
            assert completion.text == backend.tokenizer.decode(ids, skip_special_tokens=True)


# --- where vLLM cannot run -----------------------------------------------------------------
def test_missing_vllm_gives_install_instructions(policies, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError) as error:
        VLLMSampler(policies, "unused")
    message = str(error.value)
    assert "vllm" in message and "pip install" in message
    assert "--generation-backend hf" in message
    assert "\n" not in message  # one paragraph


def test_no_cuda_is_named(policies, fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_sampler, "_cuda_available", lambda: False)
    with pytest.raises(VLLMUnavailableError, match="no CUDA GPU") as error:
        VLLMSampler(policies, "unused")
    assert "--generation-backend hf" in str(error.value)
    assert not fake_vllm.LLM.instances  # nothing was started


@pytest.mark.parametrize("setup", ["full", "separate_models"])
def test_only_shared_lora_is_supported(setup, tiny_model_path, tmp_path, monkeypatch):  # noqa: F811
    if setup == "full":
        unsupported = load_policies(AGENTS, [tiny_model_path] * 2, finetune="full")
    else:
        other = str(build_tiny_model(tmp_path / "other", seed=1))
        unsupported = load_policies(AGENTS, [tiny_model_path, other])
    monkeypatch.setitem(sys.modules, "vllm", None)  # the mode check must come first
    with pytest.raises(ValueError, match="--generation-backend hf") as error:
        VLLMSampler(unsupported, tiny_model_path)
    assert "LoRA" in str(error.value) and "shared base" in str(error.value)


# --- conversion of vLLM outputs --------------------------------------------------------------
@pytest.mark.parametrize(
    ("token_ids", "finish_reason", "stop_reason", "expected", "finished"),
    [
        ([10, 11, 2], "stop", 2, [10, 11, 2], True),  # V1: the stop token is kept
        ([10, 11], "stop", 2, [10, 11, 2], True),  # a version that drops it: put back
        ([10, 11], "stop", None, [10, 11, 2], True),  # stopped on the model's own EOS
        ([10, 11, 12], "length", None, [10, 11, 12], False),
        ([10, 2, 11], "length", None, [10, 2], True),  # tokens after the first EOS are cut
        ([10, 2], "length", None, [10, 2], True),  # EOS as the last allowed token
        ([2], "stop", 2, [2], True),
    ],
)
def test_completion_from_vllm(token_ids, finish_reason, stop_reason, expected, finished):
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    assert eos == 2
    completion = completion_from_vllm(
        "alice", [1, 5], tuple(token_ids), finish_reason, stop_reason, [eos], tokenizer, eos
    )
    assert completion.completion_ids == expected
    assert completion.finished is finished
    assert completion.prompt_ids == [1, 5]
    assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)


# --- the sampler against a fake vLLM ---------------------------------------------------------
class FakeSamplingParams:
    def __init__(
        self,
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        seed=None,
        max_tokens=16,
        stop_token_ids=None,
        stop=None,
        include_stop_str_in_output=False,
    ):
        if temperature < 1e-5 and n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {n}.")
        if top_k < -1 or top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.seed, self.max_tokens = seed, max_tokens
        self.stop_token_ids = list(stop_token_ids or [])


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    text: str = ""


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput] = field(default_factory=list)


class FakeLLM:
    instances: list[FakeLLM] = []
    drop_stop_token = False  # simulate a vLLM that strips the EOS from token_ids

    def __init__(self, **settings):
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.base = AutoModelForCausalLM.from_pretrained(settings["model"]).eval()
        self.adapters: dict[int, torch.nn.Module] = {}  # like vLLM: loaded once per int id
        self.calls: list[dict] = []
        self.shut_down = False
        FakeLLM.instances.append(self)

    def _adapter(self, request: FakeLoRARequest):
        from peft import PeftModel

        if request.lora_int_id not in self.adapters:
            path = Path(request.lora_path)
            assert (path / "adapter_config.json").is_file(), f"no adapter at {path}"
            model = PeftModel.from_pretrained(copy.deepcopy(self.base), path)
            self.adapters[request.lora_int_id] = model.eval()
        return self.adapters[request.lora_int_id]

    @torch.inference_mode()
    def generate(self, prompts, sampling_params, *, lora_request, use_tqdm=True):
        assert not self.shut_down
        if isinstance(sampling_params, list):
            assert len(sampling_params) == len(prompts)
        assert isinstance(lora_request, list) and len(lora_request) == len(prompts)
        self.calls.append({"prompts": prompts, "params": sampling_params, "lora": lora_request})
        results = []
        for i, prompt in enumerate(prompts):
            params = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            model = self._adapter(lora_request[i])
            ids = torch.tensor([prompt["prompt_token_ids"]])
            outputs = [self._one(model, ids, params, k) for k in range(params.n)]
            results.append(FakeRequestOutput(list(ids[0].tolist()), outputs[::-1]))  # any order
        return results

    def _one(self, model, ids, params, index):
        kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if params.temperature > 0:
            kwargs = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k if params.top_k > 0 else 0,
            }
        with torch.random.fork_rng():
            if params.seed is not None:
                torch.manual_seed(params.seed + index)  # V1: child k gets seed + k
            output = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=params.max_tokens,
                eos_token_id=params.stop_token_ids,
                pad_token_id=params.stop_token_ids[0],
                **kwargs,
            )
        tokens = output[0, ids.shape[1] :].tolist()
        for position, token in enumerate(tokens):
            if token in params.stop_token_ids:
                kept = tokens[: position if self.drop_stop_token else position + 1]
                return FakeCompletionOutput(index, kept, "stop", token)
        return FakeCompletionOutput(index, tokens, "length", None)

    def shutdown(self):
        self.shut_down = True


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    vllm.inputs, vllm.lora, lora.request = inputs, lora, request
    for name, module in [
        ("vllm", vllm),
        ("vllm.inputs", inputs),
        ("vllm.lora", lora),
        ("vllm.lora.request", request),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_sampler, "_cuda_available", lambda: True)
    monkeypatch.setattr(FakeLLM, "instances", [])
    return vllm


@pytest.fixture
def sampler(policies, tiny_model_path, fake_vllm):  # noqa: F811
    with VLLMSampler(policies, tiny_model_path, enforce_eager=True) as opened:
        yield opened


def test_engine_settings(sampler, tiny_model_path):  # noqa: F811
    (llm,) = FakeLLM.instances
    assert llm.settings == {
        "model": tiny_model_path,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "seed": 0,
        "enforce_eager": True,
    }


def test_greedy_equals_hf_sampler(sampler, policies):
    groups = sampler.sample(REQUESTS, 3, GREEDY)
    check_conventions(policies, REQUESTS, groups, 3, GREEDY.max_new_tokens)
    expected = policies.sample(REQUESTS, 3, GREEDY)
    assert [[c.completion_ids for c in g] for g in groups] == [
        [c.completion_ids for c in g] for g in expected
    ]
    assert [[c.text for c in g] for g in groups] == [[c.text for c in g] for g in expected]
    assert groups[0][0].completion_ids != groups[1][0].completion_ids  # adapters differ
    # one generate call for all requests, greedy sent once per prompt (vLLM rejects n > 1)
    (call,) = FakeLLM.instances[0].calls
    assert call["params"].n == 1 and call["params"].temperature == 0.0
    assert [r.lora_name for r in call["lora"]] == ["alice-v1", "bob-v1", "alice-v1"]
    assert groups[0][0].completion_ids is not groups[0][1].completion_ids  # independent copies


def test_eos_dropped_by_vllm_is_restored(sampler, policies, monkeypatch):
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    seeds = [1, 2, 3]
    kept = sampler.sample(REQUESTS, 6, params, seeds)
    monkeypatch.setattr(FakeLLM, "drop_stop_token", True)
    restored = sampler.sample(REQUESTS, 6, params, seeds)
    check_conventions(policies, REQUESTS, restored, 6, params.max_new_tokens)
    assert [[(c.completion_ids, c.finished) for c in g] for g in restored] == [
        [(c.completion_ids, c.finished) for c in g] for g in kept
    ]
    assert any(c.finished for g in restored for c in g)  # the case under test occurred


def test_sampling_params_and_seeds(sampler, policies):
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=0)
    seeds = [123456789, 987654321, 555]
    first = sampler.sample(REQUESTS, 4, params, seeds)
    check_conventions(policies, REQUESTS, first, 4, params.max_new_tokens)
    again = sampler.sample(REQUESTS, 4, params, seeds)
    ids = [[c.completion_ids for c in g] for g in first]
    assert ids == [[c.completion_ids for c in g] for g in again]
    call = FakeLLM.instances[0].calls[0]
    assert [p.seed for p in call["params"]] == seeds
    for p in call["params"]:
        assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (4, 0.7, 0.9, -1, 6)
        assert p.stop_token_ids == policies.models[0].eos_ids
    top_k = sampler.sample(REQUESTS[:1], 2, SamplingParams(6, temperature=1.0, top_k=5))
    assert len(top_k[0]) == 2 and FakeLLM.instances[0].calls[-1]["params"].top_k == 5


def test_sync_serves_the_new_adapters(sampler, policies):
    requests = REQUESTS[:2]
    before = sampler.sample(requests, 1, GREEDY)
    old_ids = {r.lora_int_id for r in sampler._lora.values()}
    old_folder = sampler._folder
    perturb_lora_b(policies, "alice", 1.0, seed=3)
    stale = sampler.sample(requests, 1, GREEDY)  # vLLM still serves the loaded version
    assert [g[0].completion_ids for g in stale] == [g[0].completion_ids for g in before]
    sampler.sync()
    after = sampler.sample(requests, 1, GREEDY)
    assert after[0][0].completion_ids != before[0][0].completion_ids  # alice changed
    assert after[1][0].completion_ids == before[1][0].completion_ids  # bob did not
    assert [g[0].completion_ids for g in after] == [
        g[0].completion_ids for g in policies.sample(requests, 1, GREEDY)
    ]
    new = sampler._lora
    assert not {r.lora_int_id for r in new.values()} & old_ids  # new ids force a reload
    assert {r.lora_name for r in new.values()} == {"alice-v2", "bob-v2"}  # new prefix-cache keys
    assert not old_folder.exists() and sampler._folder.is_dir()


def test_close_stops_engine_and_deletes_adapters(policies, tiny_model_path, fake_vllm):  # noqa: F811
    sampler = VLLMSampler(policies, tiny_model_path)
    workdir = Path(sampler._workdir.name)
    assert any(workdir.rglob("adapter_config.json"))
    sampler.close()
    assert FakeLLM.instances[0].shut_down and not workdir.exists()
    sampler.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sampler.sample(REQUESTS, 1, GREEDY)


def test_large_lora_rank_picks_the_next_vllm_rank(tiny_model_path, fake_vllm):  # noqa: F811
    wide = load_policies(AGENTS, [tiny_model_path] * 2, lora_rank=12)
    with VLLMSampler(wide, tiny_model_path):
        assert FakeLLM.instances[0].settings["max_lora_rank"] == 16


# --- the real engine -------------------------------------------------------------------------
def build_vllm_friendly_model(folder: Path) -> Path:
    """Like build_tiny_model, with head size 64 (vLLM's attention kernels need >= 32)."""
    return build_tiny_model(
        folder,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        tie_word_embeddings=False,
    )


@pytest.mark.slow
def test_real_vllm_on_gpu(tmp_path):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    path = str(build_vllm_friendly_model(tmp_path / "model"))
    policies = load_policies(AGENTS, [path] * 2)  # the HF side stays on CPU: vLLM gets the GPU
    perturb_lora_b(policies, "alice", 0.3, seed=1)
    perturb_lora_b(policies, "bob", 0.3, seed=2)
    requests = REQUESTS[:2]
    with VLLMSampler(
        policies,
        path,
        dtype="float16",  # also on GPUs without bfloat16
        gpu_memory_utilization=0.3,
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=False,  # same kernels on every call: greedy repeats exactly
    ) as sampler:
        groups = sampler.sample(requests, 3, GREEDY)
        check_conventions(policies, requests, groups, 3, GREEDY.max_new_tokens)
        for group in groups:
            assert len({tuple(c.completion_ids) for c in group}) == 1

        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        seeded = sampler.sample(requests, 4, params, seeds=[11, 22])
        check_conventions(policies, requests, seeded, 4, params.max_new_tokens)
        again = sampler.sample(requests, 4, params, seeds=[11, 22])
        assert [[c.completion_ids for c in g] for g in seeded] == [
            [c.completion_ids for c in g] for g in again
        ]
        flat = [c for group in seeded for c in group if c.agent == "alice"]
        batch = policies.logprobs(flat)  # the HF model scores vLLM's tokens
        assert torch.isfinite(batch.logprobs[batch.mask.bool()]).all()

        before = [g[0].completion_ids for g in sampler.sample(requests, 1, GREEDY)]
        perturb_lora_b(policies, "alice", 2.0, seed=3)
        stale = [g[0].completion_ids for g in sampler.sample(requests, 1, GREEDY)]
        assert stale == before  # served adapters change only on sync()
        sampler.sync()
        after = [g[0].completion_ids for g in sampler.sample(requests, 1, GREEDY)]
        assert after[0] != before[0] and after[1] == before[1]
