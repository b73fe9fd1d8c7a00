"""Where a task's records come from: a Hugging Face dataset id, a local file, or a bundled copy.

Everything is read through ``datasets`` so that a local file and a Hub dataset behave alike.
Records are validated once, at load time, so that a malformed file fails with a message that
names the file, the record and the field, instead of a ``KeyError`` in the middle of training.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import DataFormatError, DataUnavailableError

LOCAL_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


class Records(Sequence):
    """An immutable list of dataset records, shared (never copied) by every branch of an env.

    ``copy.deepcopy(env)`` is how a trainer branches an episode; returning ``self`` here keeps
    that cheap no matter how large the dataset is.
    """

    def __init__(self, items: Sequence[dict[str, Any]], source: str):
        self._items = tuple(items)
        self.source = source

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # type: ignore[override]
        return self._items[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._items)

    def __deepcopy__(self, memo: dict) -> Records:
        return self

    def __repr__(self) -> str:
        return f"Records({len(self)} items from {self.source!r})"


def _local_format(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, builder in LOCAL_SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    return None


def looks_like_path(source: str) -> bool:
    """Hub ids are ``owner/name``; a file suffix, a leading ``.``, ``/`` or ``~``, or an existing
    file or folder makes a path."""
    return (
        os.path.exists(os.path.expanduser(source))
        or source.startswith((".", "/", "~"))
        or _local_format(Path(source)) is not None
    )


def _load_folder(path: Path, split: str):
    """A ``save_to_disk`` folder, or a folder of data files named by split (``train.jsonl``...).

    The second kind is loaded by ``datasets`` itself, which infers the splits from file names.
    """
    import datasets

    saved = (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()
    try:
        loaded = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as error:  # noqa: BLE001 - the loader's own message is passed on
        raise DataUnavailableError(
            f"Could not read the dataset folder {path}: {error}. A folder must be written by "
            "`save_to_disk`, or hold data files named by split (train.jsonl, test.jsonl, ...)."
        ) from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataUnavailableError(
                f"The dataset folder {path} has the splits {sorted(loaded)}, not {split!r}. "
                "Pass split= with one of them."
            )
        return loaded[split]
    return loaded


def _load_local(path: Path, split: str):
    import datasets

    if path.is_dir():
        return _load_folder(path, split)
    builder = _local_format(path)
    if builder is None:
        raise DataUnavailableError(
            f"Cannot read {path}: unknown file type. Supported: "
            f"{', '.join(sorted(LOCAL_SUFFIXES))} files, or a `save_to_disk` folder."
        )
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:  # noqa: BLE001 - the parser's own message is passed on
        raise DataFormatError(
            f"Could not parse {path} as {builder}: {error}. The file must be a list of records "
            "(JSON array, one JSON object per line, or a table) with the fields the task needs."
        ) from error


def _load_hub(dataset_id: str, split: str, task: str):
    import datasets

    try:
        return datasets.load_dataset(dataset_id, split=split)
    except Exception as error:  # noqa: BLE001 - offline, missing, renamed: the user fixes all alike
        raise DataUnavailableError(
            f"The {task} environment could not load the dataset {dataset_id!r} (split "
            f"{split!r}) from the Hugging Face Hub: {type(error).__name__}: {error}. If this "
            "machine is offline, download the data elsewhere and pass it as a local file or "
            f"folder with data='path/to/file.jsonl' (command line: --data PATH)."
        ) from error


def load_records(
    source: str | os.PathLike,
    *,
    split: str,
    required_fields: Sequence[str],
    task: str,
) -> Records:
    """Load and validate the records of ``source``.

    ``split`` selects a split of a Hub dataset or of a ``DatasetDict`` folder; a single local
    file is one split and ``split`` does not apply to it.
    """
    source = os.fspath(source)
    if looks_like_path(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise DataUnavailableError(
                f"The {task} data file {path} does not exist. Pass data= with an existing "
                "local file or folder, or a Hugging Face dataset id."
            )
        dataset = _load_local(path, split)
    else:
        dataset = _load_hub(source, split, task)
    items = dataset.to_list()
    validate_records(items, required_fields, source)
    return Records(items, source)


def validate_records(items: Sequence[Any], required_fields: Sequence[str], source: str) -> None:
    """Every record must be a mapping with a string value for every required field."""
    if not items:
        raise DataFormatError(f"{source} holds no records.")
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise DataFormatError(
                f"Record {position} of {source} is a {type(item).__name__}, not an object "
                f"with the fields {list(required_fields)}."
            )
        missing = [name for name in required_fields if not isinstance(item.get(name), str)]
        if missing:
            raise DataFormatError(
                f"Record {position} of {source} lacks the text field(s) {missing} (it has "
                f"{sorted(item)}). Every record needs {list(required_fields)}."
            )
