"""Checkpoint files written through a temporary file beside the target, and the temporaries that
killed writes left behind removed when the next run starts."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".lorafusion-tmp"
# ".<checkpoint file name>.<8 random characters of mkstemp>.lorafusion-tmp"
_TEMP_FILE = re.compile(r"\..+\.[A-Za-z0-9_]{8}" + re.escape(TEMP_SUFFIX))


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` for local paths that writes ``.<name>.<random>.lorafusion-tmp`` in the
    checkpoint's own directory, syncs it and renames it over the target: a reader sees the old
    checkpoint or the new one, and a write killed midway leaves its temporary where
    ``remove_stale_temporaries`` finds it (Lightning's default writes through fsspec, whose
    temporary goes to ``$TMPDIR`` and stays there). Remote URLs go to Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete the temporaries ``AtomicCheckpointIO`` left in ``directory`` when a write was killed
    (only files named by its pattern); returns their names."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if _TEMP_FILE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry.name)
    if removed:
        log.info("removed %d temporary checkpoint file(s) of interrupted writes in %s: %s",
                 len(removed), root, ", ".join(sorted(removed)))
    return removed
