"""`lightning-lorafusion fit --config run.yaml`: a thin LightningCLI over the library."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator

from lightning.pytorch.cli import LightningCLI

from .specs import ConfigError
from .training.datamodule import MultiAdapterDataModule
from .training.module import LoRAFusionModule

# Exit statuses: 0 success, 1 unexpected error (traceback), 2 usage or configuration error
# (argparse uses 2 for usage errors too).
EXIT_OK, EXIT_BUG, EXIT_USER = 0, 1, 2
# Mistakes a user makes and fixes (the message says how): reported in one line, no traceback.
# FloatingPointError is the module's "adapter diverged, lower its lr" stop.
USER_ERRORS = (ConfigError, FileNotFoundError, FloatingPointError)
DEBUG_FLAG = "--debug"
DEBUG_ENV = "LORAFUSION_DEBUG"

DESCRIPTION = "Train many LoRA adapters of one frozen LLM at once (fused kernels, MILP planner)."
EPILOG = (
    "Also: 'lightning-lorafusion serve --help' (multi-adapter generation server), "
    "'lightning-lorafusion generate --help' (prompts from a file through the adapters). "
    "Exit status: 0 success; 2 usage or configuration error, reported as one 'error:' line "
    f"({DEBUG_FLAG} or {DEBUG_ENV}=1 adds the traceback); 1 unexpected error."
)


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


@contextlib.contextmanager
def _without_inapplicable_lightning_warnings() -> Iterator[None]:
    """Silence exactly two Lightning warnings a user of this CLI cannot act on."""
    with warnings.catch_warnings():
        # ModelCheckpoint(every_n_train_steps=...) under manual optimization warns that the
        # checkpoint holds the state *after* the optimizer step. That is what ours must hold:
        # post-step adapters and optimizer states plus the partial global batches' gradients
        # and the data position (LoRAFusionModule.on_save_checkpoint), so resume is exact.
        warnings.filterwarnings(
            "ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning
        )
        # Lightning's own pytree helper (CombinedLoader) builds torch's deprecated LeafSpec on
        # every run with torch >= 2.10; nothing in a config can avoid it.
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        yield


def _exit_status(code: object) -> int:
    """SystemExit's code as a process exit status (argparse: 0 for --help, 2 for usage errors)."""
    if code is None:
        return EXIT_OK
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") semantics
    return EXIT_BUG


def _report_user_error(err: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {message}", file=sys.stderr)
    if not debug:
        print(f"hint: fix the configuration or data named above; add {DEBUG_FLAG} (or set "
              f"{DEBUG_ENV}=1) for the traceback", file=sys.stderr)
    return EXIT_USER


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: the process's arguments); return the exit status.

    ``fit`` / ``validate`` (and ``--print_config``, ``--help``) go to LightningCLI; ``serve``
    and ``generate`` go to the generation server's and the generate command's own parsers.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    args = [a for a in args if a != DEBUG_FLAG]
    if debug:  # processes Lightning launches for more devices inherit it
        os.environ[DEBUG_ENV] = "1"
    if args and args[0] == "serve":
        from .serving.serve_cli import run as serve_run  # lazy: the server's deps only for serve

        return serve_run(args[1:])
    if args and args[0] == "generate":
        from .serving.generate_cli import run as generate_run  # lazy: no Lightning needed

        return generate_run(args[1:])
    if argv is None:
        # LightningCLI reads sys.argv itself (it warns when given args as well); only the
        # --debug flag, which is ours, is taken out of it.
        sys.argv[1:] = args
    _keep_wandb_local()
    _log_to_stderr()
    try:
        with _without_inapplicable_lightning_warnings():
            LoRAFusionCLI(
                LoRAFusionModule,
                MultiAdapterDataModule,
                args=None if argv is None else args,
                save_config_kwargs={"overwrite": True},
                parser_kwargs={
                    "description": DESCRIPTION,
                    "epilog": EPILOG,
                    "fit": {"default_config_files": []},
                },
            )
    except SystemExit as exit_:  # argparse: --help, --print_config, usage errors
        return _exit_status(exit_.code)
    except USER_ERRORS as err:
        return _report_user_error(err, debug)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
