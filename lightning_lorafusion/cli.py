"""`lightning-lorafusion fit --config run.yaml`: a thin LightningCLI over the library."""

from __future__ import annotations

import logging
import os
import sys

from lightning.pytorch.cli import LightningCLI

from .training.datamodule import MultiAdapterDataModule
from .training.module import LoRAFusionModule


def _keep_wandb_local() -> None:
    """W&B offline files go under the run directory, never HOME (unless the user set them)."""
    root = os.environ.get("WANDB_DIR", os.path.join(os.getcwd(), "runs", "wandb"))
    os.environ.setdefault("WANDB_DIR", root)
    for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        os.environ.setdefault(var, os.path.join(root, sub))
    os.environ.setdefault("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.makedirs(os.environ[var], exist_ok=True)


class LoRAFusionCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults(
            {
                "trainer.max_epochs": 1,
                "trainer.log_every_n_steps": 1,
                "trainer.default_root_dir": "runs/default",
                "trainer.num_sanity_val_steps": 0,
            }
        )


def _log_to_stderr() -> None:
    """Our INFO lines (planning, datasets, exports) next to Lightning's."""
    logger = logging.getLogger("lightning_lorafusion")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lorafusion] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> LoRAFusionCLI:
    _keep_wandb_local()
    _log_to_stderr()
    return LoRAFusionCLI(
        LoRAFusionModule,
        MultiAdapterDataModule,
        args=argv if argv is not None else sys.argv[1:],
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"fit": {"default_config_files": []}},
    )


if __name__ == "__main__":
    main()
