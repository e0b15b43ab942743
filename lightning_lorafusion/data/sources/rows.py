"""Shared pieces of the row-based sources: split names, path resolution, row formats
(``RowFields``) and the tokenize-every-row loop with its length and limit handling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...specs import ConfigError
from ..tokenization import (SampleTooLongError, TokenizedSample, tokenize_messages, tokenize_prompt_completion,
                            tokenize_text)

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
ROW_FORMATS = ("auto", "prompt_completion", "messages", "text")


def check_limit(limit: int | None, kind: str) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"dataset kind {kind!r}: limit={limit!r} must be an integer >= 1 (or unset)")


def normalize_split(split: str, where: str) -> str:
    aliases = {"validation": "val", "dev": "val"}
    split = aliases.get(split, split)
    if split not in SPLITS:
        raise ConfigError(f"{where}: split={split!r}; allowed: {list(SPLITS)}")
    return split


def resolve_path(path: str | Mapping[str, str], split: str, where: str) -> Path:
    """``path`` is one file (the train split) or a mapping split -> file."""
    split = normalize_split(split, where)
    if isinstance(path, Mapping):
        path = {normalize_split(str(k), where): v for k, v in path.items()}
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


def check_file(path: Path, where: str) -> None:
    if not path.is_file():
        raise ConfigError(
            f"{where}: data file {str(path)!r} does not exist (resolved to "
            f"{str(path.resolve())!r}); fix 'path' in the adapter's dataset config"
        )


def tokenize_all(
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
