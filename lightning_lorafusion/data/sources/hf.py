"""`datasets` source: rows read with the `datasets` library (a saved dataset, data files or a
Hub id in the local cache), mapped to samples like JSONL rows.
"""

from __future__ import annotations

import glob as globlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...specs import ConfigError
from ..tokenization import TokenizedSample
from .rows import RowFields, check_limit, normalize_split, resolve_path, tokenize_all

# Local data files the `datasets` library reads, by extension: its packaged builder's name.
HF_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
HF_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
# Our split names -> the usual names of a `datasets` dataset's splits.
HF_SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}


def _file_builder(path: str) -> str | None:
    """The `datasets` builder for a data file, looking through a compression suffix."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in HF_COMPRESSION_SUFFIXES:
        suffixes.pop()
    return HF_FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


def _read_checked(rows: Iterable[Any], where: str) -> Iterator[Any]:
    """Rows of a `datasets` dataset; a row that cannot be read (a stream reads lazily, so a bad
    line shows up only here) is a ConfigError naming the source."""
    iterator = iter(rows)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except Exception as err:  # datasets/pyarrow/fsspec raise their own types for bad input
            raise ConfigError(f"{where}: cannot read a row: {type(err).__name__}: {err}") from err
        yield row


@dataclass(frozen=True, kw_only=True)
class HfSource:
    """Rows read with the `datasets` library, mapped to samples like JSONL rows (``fields``).

    ``path`` is a local data file or glob (json/jsonl/parquet/arrow/csv, optionally compressed),
    a directory written by ``save_to_disk``, a directory of data files, or a Hub dataset name
    (needs network); or a mapping split -> one of those. ``split`` names the `datasets` split to
    read (slices such as ``train[:1000]`` allowed without streaming); a single name is for our
    'train' split, a mapping ``{train: ..., val: ...}`` covers several. With ``streaming`` rows are
    read lazily, so with ``limit`` only the first rows are ever read or downloaded.
    """

    path: str | Mapping[str, str]
    split: str | Mapping[str, str] | None = None
    config_name: str | None = None  # a Hub dataset's configuration (load_dataset's `name`)
    streaming: bool = False
    cache_dir: str | None = None  # where `datasets` keeps its Arrow cache (default: HF_HOME)
    fields: RowFields = field(default_factory=RowFields)
    limit: int | None = None  # keep only the first `limit` samples
    kind: str = "hf"

    def __post_init__(self) -> None:
        check_limit(self.limit, self.kind)
        if not isinstance(self.streaming, bool):
            raise ConfigError(f"dataset kind 'hf': streaming={self.streaming!r} must be true or false")
        if not isinstance(self.path, (str, Mapping)) or not self.path:
            raise ConfigError(
                f"dataset kind 'hf': path={self.path!r}; give a data file, a directory, a Hub "
                "dataset name, or a mapping {train: ..., val: ...} of those"
            )

    def _wanted_split(self, run_split: str, where: str) -> str | None:
        """The `datasets` split the config names for our ``run_split`` (None: not named)."""
        if self.split is None:
            return None
        if isinstance(self.split, Mapping):
            chosen = {normalize_split(str(k), where): v for k, v in self.split.items()}
            if run_split not in chosen:
                raise ConfigError(f"{where}: no entry for split {run_split!r} in split={dict(self.split)!r}")
            return str(chosen[run_split])
        if run_split != "train":
            raise ConfigError(
                f"{where}: split={self.split!r} is the split read for training; to read our "
                f"{run_split!r} split, give split as a mapping, e.g. {{train: {self.split}, {run_split}: ...}}"
            )
        return str(self.split)

    def _load_dataset(self, datasets: Any, where: str, what: str, path: str, **kwargs: Any) -> Any:
        """``datasets.load_dataset(path, ...)``; any failure is a ConfigError naming ``what``."""
        try:
            return datasets.load_dataset(path, streaming=self.streaming, cache_dir=self.cache_dir, **kwargs)
        except Exception as err:  # datasets/pyarrow/fsspec/the Hub raise many types for bad input
            cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
            raise ConfigError(
                f"{where}: cannot load {what} with the datasets library: "
                f"{type(err).__name__}: {err}{cause}"
            ) from err

    def load(self, run_split: str, where: str) -> Any:
        """The `datasets` Dataset (or IterableDataset when streaming) for ``run_split``."""
        try:
            import datasets
        except ImportError as err:
            raise ConfigError(f"{where}: dataset kind 'hf' needs the datasets package; pip install datasets") from err
        wanted = self._wanted_split(run_split, where)
        if isinstance(self.path, Mapping):
            location = str(resolve_path(self.path, run_split, where))
            run_split = "train"  # the file(s) named for this split hold only it
        else:
            location = self.path
        local = Path(location).expanduser()
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            try:
                saved = datasets.load_from_disk(str(local))
            except Exception as err:  # a damaged directory: datasets/pyarrow raise their own types
                raise ConfigError(
                    f"{where}: cannot load the saved dataset {location!r}: {type(err).__name__}: {err}"
                ) from err
            if isinstance(saved, datasets.DatasetDict):
                key = wanted or HF_SPLIT_NAMES[run_split]
                if key not in saved:
                    raise ConfigError(
                        f"{where}: {location} has no split {key!r} (splits: {list(saved)}); set 'split'"
                    )
                saved = saved[key]
            elif wanted is not None or run_split != "train":
                raise ConfigError(
                    f"{where}: {location} is a saved Dataset without splits, read as the train split "
                    "only; remove 'split', or save a DatasetDict"
                )
            return saved.to_iterable_dataset() if self.streaming else saved
        if local.is_dir():  # a directory of data files: `datasets` infers the format and splits
            return self._load_dataset(
                datasets, where, f"directory {location!r}", str(local), split=wanted or HF_SPLIT_NAMES[run_split]
            )
        is_glob = any(ch in location for ch in "*?[")
        if is_glob or local.exists() or _file_builder(location) or location.startswith((".", "/", "~")):
            files = sorted(globlib.glob(str(local))) if is_glob else [str(local)] if local.is_file() else []
            if not files:
                raise ConfigError(
                    f"{where}: no data file matches {location!r} (resolved to "
                    f"{str(local.resolve())!r}); fix 'path' in the adapter's dataset config"
                )
            builders = {_file_builder(f) for f in files}
            if None in builders or len(builders) > 1:
                raise ConfigError(
                    f"{where}: {location!r} matches {files[:5]}; give files of one type among "
                    f"{sorted(HF_FILE_BUILDERS)} (compressed {list(HF_COMPRESSION_SUFFIXES)} too)"
                )
            if wanted is None and run_split != "train":
                raise ConfigError(
                    f"{where}: path={location!r} is read as the 'train' split only; for our "
                    f"{run_split!r} split give path as a mapping {{train: ..., {run_split}: ...}} "
                    f"or split as one, e.g. {{train: 'train[:90%]', {run_split}: 'train[90%:]'}}"
                )
            return self._load_dataset(
                datasets, where, repr(location), builders.pop(), data_files=files, split=wanted or "train"
            )
        return self._load_dataset(  # not on disk: a Hub dataset name
            datasets, where, f"{location!r} (not a local file or directory, so read as a Hub dataset)",
            location, name=self.config_name, split=wanted or HF_SPLIT_NAMES[run_split],
        )

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} (hf)"
        if tokenizer is None:
            raise ConfigError(f"{where}: a tokenizer is required to read text data")
        dataset = self.load(normalize_split(split, where), where)
        where = f"{where} {self.path if isinstance(self.path, str) else dict(self.path)}"
        row_fields = self.fields
        columns = dataset.column_names  # None for some streams (csv): checked per row instead
        if columns is not None:
            fmt = row_fields.format_for_columns(columns)
            if fmt is None:
                if row_fields.format == "auto":
                    wanted = (
                        f"a {row_fields.messages_field!r} column, {row_fields.prompt_field!r} + "
                        f"{row_fields.completion_field!r} columns, or a {row_fields.text_field!r} column"
                    )
                else:
                    wanted = f"column(s) {row_fields.columns_for(row_fields.format)} (format={row_fields.format})"
                raise ConfigError(
                    f"{where}: needs {wanted}; its columns are {list(columns)}. Set messages_field, "
                    "prompt_field/completion_field or text_field to the right names"
                )
            row_fields = replace(row_fields, format=fmt)
        return tokenize_all(
            _read_checked(dataset, where),
            lambda row, i: row_fields.tokenize_row(row, i, tokenizer, max_length, where),
            name=name,
            max_length=max_length,
            limit=self.limit,
        )
