"""Source kinds by name: ``parse_source`` validates an adapter's ``dataset`` mapping into a
frozen source record, ``build_source`` reads it into tokenized samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Union

from ...specs import ConfigError
from ..tokenization import TokenizedSample
from .rows import ROW_FORMATS, RowFields
from .jsonl import JsonlSource
from .parquet import ParquetSource
from .hf import HfSource
from .aclsum import AclsumSource
from .synthetic import SyntheticSource

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
