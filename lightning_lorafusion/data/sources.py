"""Adapter dataset sources (ACLSum, JSONL, Parquet, `datasets`, synthetic) read into tokenized samples.

An adapter's ``dataset`` mapping (``AdapterSpec.dataset``) names one source by ``kind``.
``parse_source`` validates it into a frozen record (call it before training starts to catch
config mistakes early); ``build_source`` parses and reads it into ``TokenizedSample``s.
"""

from __future__ import annotations

import glob as globlib
import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union

from ..specs import ConfigError
from .microbatch import IGNORE_INDEX
from .tokenization import (
    SampleTooLongError,
    TokenizedSample,
    has_chat_template,
    shifted_labels,
    tokenize_messages,
    tokenize_prompt_completion,
    tokenize_text,
)

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
ROW_FORMATS = ("auto", "prompt_completion", "messages", "text")

ACLSUM_ASPECTS = ("challenge", "approach", "outcome")
ACLSUM_SECTIONS = ("abstract", "introduction", "conclusion")
# One instruction per aspect, phrased after the ACLSum annotation guidelines' definitions.
ACLSUM_INSTRUCTIONS = {
    "challenge": "Summarize in one sentence the challenge this paper addresses: the problem "
    "or gap that motivates the work.",
    "approach": "Summarize in one sentence the approach this paper proposes: the method or "
    "idea used to address the challenge.",
    "outcome": "Summarize in one sentence the outcome of this paper: its main results and "
    "findings.",
}


def _check_limit(limit: int | None, kind: str) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"dataset kind {kind!r}: limit={limit!r} must be an integer >= 1 (or unset)")


def _normalize_split(split: str, where: str) -> str:
    aliases = {"validation": "val", "dev": "val"}
    split = aliases.get(split, split)
    if split not in SPLITS:
        raise ConfigError(f"{where}: split={split!r}; allowed: {list(SPLITS)}")
    return split


def _resolve_path(path: str | Mapping[str, str], split: str, where: str) -> Path:
    """``path`` is one file (the train split) or a mapping split -> file."""
    split = _normalize_split(split, where)
    if isinstance(path, Mapping):
        path = {_normalize_split(str(k), where): v for k, v in path.items()}
        if split not in path:
            raise ConfigError(
                f"{where}: no file for split {split!r} in path={dict(path)!r}; "
                f"add a {split!r} entry"
            )
        return Path(path[split]).expanduser()
    if split != "train":
        raise ConfigError(
            f"{where}: path={path!r} is a single file, used for the 'train' split only; to read "
            f"split {split!r}, give path as a mapping, e.g. {{train: a.jsonl, {split}: b.jsonl}}"
        )
    return Path(path).expanduser()


def _check_file(path: Path, where: str) -> None:
    if not path.is_file():
        raise ConfigError(
            f"{where}: data file {str(path)!r} does not exist (resolved to "
            f"{str(path.resolve())!r}); fix 'path' in the adapter's dataset config"
        )


def _tokenize_all(
    rows: Iterable[Any],
    tokenize_row: Callable[[Any, int], TokenizedSample],
    *,
    name: str,
    max_length: int | None,
    limit: int | None,
) -> list[TokenizedSample]:
    """Tokenize rows in order until ``limit`` samples are kept (all rows when None; rows after
    that are never read, so a stream stops there); drop (and count) rows too long for
    ``max_length``; never return an empty list."""
    samples: list[TokenizedSample] = []
    too_long: list[int] = []
    read = 0
    for index, row in enumerate(rows):
        read = index + 1
        try:
            samples.append(tokenize_row(row, index))
        except SampleTooLongError:
            too_long.append(index)
        if limit is not None and len(samples) == limit:
            break
    if too_long:
        log.warning(
            "adapter dataset %s: dropped %d of %d samples that do not fit max_length=%s "
            "(first rows: %s); raise max_length to keep them",
            name, len(too_long), read, max_length, too_long[:10],
        )
    if not samples:
        detail = (
            f"all {read} samples are longer than max_length={max_length}"
            if read
            else "the source has no rows"
        )
        raise ConfigError(f"adapter dataset {name} is empty: {detail}")
    return samples


@dataclass(frozen=True, kw_only=True)
class RowFields:
    """Which fields of a row hold the text, and which row format to expect."""

    format: str = "auto"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    text_field: str = "text"
    add_eos: bool = True

    def columns_for(self, fmt: str) -> list[str]:
        """The fields a row of format ``fmt`` ("messages", "prompt_completion", "text") needs."""
        return {
            "messages": [self.messages_field],
            "prompt_completion": [self.prompt_field, self.completion_field],
            "text": [self.text_field],
        }[fmt]

    def format_for_columns(self, columns: Sequence[str]) -> str | None:
        """The row format a table with ``columns`` is read in: ``format``, or for "auto" the
        first complete match in the per-row order (messages, prompt/completion, text); None
        when the table lacks a column that format needs."""
        candidates = ROW_FORMATS[1:] if self.format == "auto" else (self.format,)
        for fmt in ("messages", "prompt_completion", "text"):
            if fmt in candidates and all(c in columns for c in self.columns_for(fmt)):
                return fmt
        return None

    def tokenize_row(
        self, row: Any, index: int, tokenizer: Any, max_length: int | None, where: str
    ) -> TokenizedSample:
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: row {index} is a {type(row).__name__}, expected an object")
        fmt = self.format
        if fmt == "auto":
            if self.messages_field in row:
                fmt = "messages"
            elif self.prompt_field in row or self.completion_field in row:
                fmt = "prompt_completion"
            elif self.text_field in row:
                fmt = "text"
            else:
                raise ConfigError(
                    f"{where}: row {index} has neither {self.messages_field!r} nor "
                    f"{self.prompt_field!r}/{self.completion_field!r} nor {self.text_field!r} "
                    f"(fields: {sorted(row)}); set prompt_field/completion_field, messages_field "
                    "or text_field to the right names"
                )
        if fmt == "messages":
            if self.messages_field not in row:
                raise ConfigError(
                    f"{where}: row {index} has no field {self.messages_field!r} "
                    f"(fields: {sorted(row)})"
                )
            try:
                return tokenize_messages(
                    tokenizer, row[self.messages_field], max_length=max_length, source_index=index
                )
            except SampleTooLongError:
                raise
            except ValueError as err:
                raise ConfigError(f"{where}: row {index}: {err}") from err
        if fmt == "text":
            if row.get(self.text_field) is None:
                raise ConfigError(
                    f"{where}: row {index} has no field {self.text_field!r} (fields: {sorted(row)}); "
                    "set text_field to the right name"
                )
            try:
                return tokenize_text(
                    tokenizer, row[self.text_field], max_length=max_length,
                    add_eos=self.add_eos, source_index=index,
                )
            except SampleTooLongError:
                raise
            except (ValueError, TypeError) as err:
                raise ConfigError(f"{where}: row {index}: {err}") from err
        for needed in (self.prompt_field, self.completion_field):
            if needed not in row or row[needed] is None:
                raise ConfigError(
                    f"{where}: row {index} has no field {needed!r} (fields: {sorted(row)}); "
                    "set prompt_field/completion_field to the right names"
                )
        try:
            return tokenize_prompt_completion(
                tokenizer,
                row[self.prompt_field],
                row[self.completion_field],
                max_length=max_length,
                add_eos=self.add_eos,
                source_index=index,
            )
        except SampleTooLongError:
            raise
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: row {index}: {err}") from err


@dataclass(frozen=True, kw_only=True)
class JsonlSource:
    """One JSON object per line: prompt/completion fields or a ``messages`` list."""

    path: str | Mapping[str, str]
    fields: RowFields = field(default_factory=RowFields)
    limit: int | None = None  # keep only the first `limit` samples
    kind: str = "jsonl"

    def __post_init__(self) -> None:
        _check_limit(self.limit, self.kind)

    def read_rows(self, path: Path, where: str) -> list[Any]:
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where}: {path} line {line_no} is not valid JSON: {err}") from err
        return rows

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} ({self.kind})"
        path = _resolve_path(self.path, split, where)
        _check_file(path, where)
        if tokenizer is None:
            raise ConfigError(f"{where}: a tokenizer is required to read text data")
        rows = self.read_rows(path, where)
        where = f"{where} {path}"
        return _tokenize_all(
            rows,
            lambda row, i: self.fields.tokenize_row(row, i, tokenizer, max_length, where),
            name=name,
            max_length=max_length,
            limit=self.limit,
        )


@dataclass(frozen=True, kw_only=True)
class ParquetSource(JsonlSource):
    """A Parquet table with the same columns as the JSONL rows (read with pyarrow)."""

    kind: str = "parquet"

    def read_rows(self, path: Path, where: str) -> list[Any]:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ConfigError(
                f"{where}: reading Parquet needs pyarrow; pip install 'pyarrow>=15'"
            ) from err
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises its own error types for corrupt files
            raise ConfigError(f"{where}: cannot read {path} as Parquet: {err}") from err


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
        _check_limit(self.limit, self.kind)
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
            chosen = {_normalize_split(str(k), where): v for k, v in self.split.items()}
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
            location = str(_resolve_path(self.path, run_split, where))
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
        dataset = self.load(_normalize_split(split, where), where)
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
        return _tokenize_all(
            _read_checked(dataset, where),
            lambda row, i: row_fields.tokenize_row(row, i, tokenizer, max_length, where),
            name=name,
            max_length=max_length,
            limit=self.limit,
        )


def aclsum_data_dir() -> Path:
    """Where the installed ``aclsum`` package keeps its JSONL files (found without importing
    it: its ``__init__`` needs ``sienna``, which we do not)."""
    spec = importlib.util.find_spec("aclsum")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "dataset kind 'aclsum' needs the 'aclsum' package (ACLSum corpus); "
            "pip install aclsum --no-deps"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "dataset"


def read_aclsum(split: str) -> list[dict[str, Any]]:
    """ACLSum documents of one split as dicts (id, title, summary, sentences, ...)."""
    path = aclsum_data_dir() / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(f"ACLSum split file {str(path)!r} is missing; reinstall the aclsum package")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True, kw_only=True)
class AclsumSource:
    """ACLSum papers -> one aspect's summary: prompt = instruction + title + paper start.

    The paper text (``sections`` in paper order, ACLSum's own sentence split) is cut to
    ``max_document_tokens`` tokens, keeping its beginning, so samples stay short enough for
    CPU training. With a chat template the sample is a user/assistant conversation, else a
    plain prompt ending in "Summary:".
    """

    aspect: str
    split: str | None = None
    max_document_tokens: int = 384
    sections: tuple[str, ...] = ACLSUM_SECTIONS
    use_chat_template: bool | None = None  # None: when the tokenizer has one
    limit: int | None = None  # keep only the first `limit` papers
    kind: str = "aclsum"

    def __post_init__(self) -> None:
        _check_limit(self.limit, self.kind)
        if self.aspect not in ACLSUM_ASPECTS:
            raise ConfigError(
                f"dataset kind 'aclsum': aspect={self.aspect!r}; allowed: {list(ACLSUM_ASPECTS)}"
            )
        if self.split is not None:
            object.__setattr__(self, "split", _normalize_split(self.split, "dataset kind 'aclsum'"))
        if isinstance(self.sections, (list, str)):
            sections = [self.sections] if isinstance(self.sections, str) else self.sections
            object.__setattr__(self, "sections", tuple(sections))
        unknown = [s for s in self.sections if s not in ACLSUM_SECTIONS]
        if unknown or not self.sections:
            raise ConfigError(
                f"dataset kind 'aclsum': sections={list(self.sections)}; allowed: non-empty "
                f"subset of {list(ACLSUM_SECTIONS)}"
            )
        if self.max_document_tokens < 1:
            raise ConfigError(
                f"dataset kind 'aclsum': max_document_tokens={self.max_document_tokens} must be >= 1"
            )

    def prompt_text(self, tokenizer: Any, doc: Mapping[str, Any]) -> str:
        text = " ".join(s for section in self.sections for s in doc["sentences"].get(section, []))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_document_tokens:
            text = tokenizer.decode(ids[: self.max_document_tokens]).rstrip() + " ..."
        return f"{ACLSUM_INSTRUCTIONS[self.aspect]}\n\nTitle: {doc['title']}\n\n{text}"

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} (aclsum)"
        if tokenizer is None:
            raise ConfigError(f"{where}: a tokenizer is required to read text data")
        split = self.split or _normalize_split(split, where)
        docs = read_aclsum(split)
        chat = has_chat_template(tokenizer) if self.use_chat_template is None else self.use_chat_template
        if chat and not has_chat_template(tokenizer):
            raise ConfigError(f"{where}: use_chat_template=true but the tokenizer has no chat template")

        def tokenize_doc(doc: Mapping[str, Any], index: int) -> TokenizedSample:
            summary = doc["summary"][self.aspect].strip()
            prompt = self.prompt_text(tokenizer, doc)
            if chat:
                messages = [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": summary},
                ]
                return tokenize_messages(
                    tokenizer, messages, max_length=max_length, source_index=index
                )
            return tokenize_prompt_completion(
                tokenizer, prompt + "\n\nSummary:", " " + summary,
                max_length=max_length, source_index=index,
            )

        return _tokenize_all(
            docs, tokenize_doc, name=name, max_length=max_length, limit=self.limit
        )


@dataclass(frozen=True, kw_only=True)
class SyntheticSource:
    """Random token samples whose lengths follow a published dataset's length distribution
    (``lightning_lorafusion.data.synthetic``); for tests and benchmarks."""

    distribution: str
    num_samples: int
    seed: int = 0
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    limit: int | None = None  # keep the first `limit` of the num_samples drawn
    kind: str = "synthetic"

    def __post_init__(self) -> None:
        _check_limit(self.limit, self.kind)
        if self.num_samples < 1:
            raise ConfigError(
                f"dataset kind 'synthetic': num_samples={self.num_samples} must be >= 1"
            )
        from .synthetic import DISTRIBUTION_NAMES  # lazy: numpy only for this kind

        if self.distribution not in DISTRIBUTION_NAMES:
            raise ConfigError(
                f"dataset kind 'synthetic': distribution={self.distribution!r}; "
                f"allowed: {list(DISTRIBUTION_NAMES)}"
            )
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError(f"dataset kind 'synthetic': vocab_size={self.vocab_size} must be >= 2")

    def build(
        self, tokenizer: Any, *, split: str, max_length: int | None, name: str
    ) -> list[TokenizedSample]:
        where = f"adapter dataset {name} (synthetic)"
        vocab_size = self.vocab_size
        if vocab_size is None:
            if tokenizer is None:
                raise ConfigError(f"{where}: without a tokenizer, set 'vocab_size' explicitly")
            vocab_size = len(tokenizer)
        from .synthetic import synthetic_token_samples  # lazy: only this kind needs it

        # Each split gets its own stream so val/test never repeat train samples.
        seed = self.seed + 1_000_003 * SPLITS.index(_normalize_split(split, where))
        try:
            pairs = synthetic_token_samples(
                self.distribution, self.num_samples,
                vocab_size=vocab_size, seed=seed, max_length=max_length,
            )
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from err
        # synthetic_token_samples marks targets in place (labels == input_ids on the
        # completion); our samples carry pre-shifted labels.
        samples = [
            TokenizedSample(
                input_ids=tuple(ids),
                labels=shifted_labels(ids, [t != IGNORE_INDEX for t in targets]),
                source_index=i,
            )
            for i, (ids, targets) in enumerate(pairs[: self.limit])
        ]
        if not samples:
            raise ConfigError(f"adapter dataset {name} is empty")
        return samples


SourceSpec = Union[AclsumSource, HfSource, JsonlSource, ParquetSource, SyntheticSource]
SOURCE_KINDS: dict[str, type] = {
    "aclsum": AclsumSource,
    "hf": HfSource,
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
    "synthetic": SyntheticSource,
}
_ROW_FIELD_KEYS = tuple(f.name for f in fields(RowFields))


def parse_source(spec: Mapping[str, Any], *, name: str = "<unnamed>") -> SourceSpec:
    """Validate an adapter's dataset mapping into a frozen source record (no I/O)."""
    if isinstance(spec, SourceSpec.__args__):  # already parsed
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"adapter {name}: dataset must be a mapping with a 'kind', got {type(spec).__name__}"
        )
    kind = spec.get("kind")
    if kind not in SOURCE_KINDS:
        raise ConfigError(
            f"adapter {name}: dataset kind={kind!r}; allowed: {sorted(SOURCE_KINDS)} "
            "(e.g. {kind: jsonl, path: train.jsonl})"
        )
    cls = SOURCE_KINDS[kind]
    params = {k: v for k, v in spec.items() if k != "kind"}
    if "fields" in {f.name for f in fields(cls)}:  # row sources: the RowFields keys sit flat
        row_keys = {k: params.pop(k) for k in list(params) if k in _ROW_FIELD_KEYS}
        if row_keys.get("format", "auto") not in ROW_FORMATS:
            raise ConfigError(
                f"adapter {name}: dataset format={row_keys['format']!r}; allowed: {list(ROW_FORMATS)}"
            )
        params["fields"] = RowFields(**row_keys)
        if "path" not in params:
            raise ConfigError(f"adapter {name}: dataset kind {kind!r} needs a 'path'")
    allowed = {f.name for f in fields(cls)} - {"kind"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        shown = sorted((allowed - {"fields"}) | (set(_ROW_FIELD_KEYS) if "fields" in allowed else set()))
        raise ConfigError(
            f"adapter {name}: unknown dataset key(s) {unknown} for kind {kind!r}; allowed: {shown}"
        )
    try:
        return cls(**params)
    except TypeError as err:  # a required key is missing
        raise ConfigError(f"adapter {name}: dataset kind {kind!r}: {err}") from err


def build_source(
    spec: Mapping[str, Any] | SourceSpec,
    tokenizer: Any,
    *,
    split: str = "train",
    max_length: int | None = None,
    name: str = "<unnamed>",
) -> list[TokenizedSample]:
    """Read an adapter's dataset into tokenized samples (pre-shifted labels, see tokenization).

    ``max_length`` caps sample length (prompts are cut from the left, samples that still do
    not fit are dropped with a warning); ``name`` is the adapter's, for error messages.
    Raises ``ConfigError`` for unknown kinds, missing files or fields, and empty results.
    """
    if max_length is not None and max_length < 2:
        raise ConfigError(f"adapter {name}: max_length={max_length} must be >= 2")
    source = parse_source(spec, name=name)
    return source.build(tokenizer, split=split, max_length=max_length, name=name)
