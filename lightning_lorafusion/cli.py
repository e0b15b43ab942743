"""`lightning-lorafusion fit --config run.yaml` (and `validate`, `test`): a thin LightningCLI over
the library, whose errors are one line with a hint."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from .capture import expandable_segments_by_default
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


# Names other tools use for our fields (PEFT, transformers' TrainingArguments): a typo hint
# offers ours even where the spelling is far off.
KNOWN_ALIASES = {
    "learning_rate": "lr", "r": "rank", "lora_r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "batch_size": "global_batch_size", "per_device_train_batch_size": "global_batch_size",
    "num_train_epochs": "max_epochs", "epochs": "max_epochs", "warmup": "warmup_steps",
    "lr_scheduler_type": "lr_schedule", "train_dataset": "dataset", "eval_dataset": "val_dataset",
}


# Keys that became fields of a section: a config still using the old key is refused with a hint
# naming the new one.
RENAMED_KEYS = {
    "model.base_precision": "model.precision.base",
    "model.fp8_emulate": "model.precision.fp8.emulate",
    "model.fp8_exempt_layers": "model.precision.fp8.exempt_layers",
    "model.fp8_fast_accumulation": "model.precision.fp8.fast_accumulation",
    "data.planner": "data.planner.method",
    "data.planner_time_limit": "data.planner.time_limit",
    "data.planner_window": "data.planner.window",
    "data.planner_workers": "data.planner.workers",
}


class UsageError(Exception):
    """A command line or config the parser refused: its message in one line, and a hint."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def _suggest(word: str, accepted: list[str]) -> str | None:
    """The accepted key closest to ``word`` (a known alias of its last dotted part first)."""
    prefix, _, last = word.rpartition(".")
    alias = KNOWN_ALIASES.get(last)
    if alias is not None and (f"{prefix}.{alias}" if prefix else alias) in accepted:
        return f"{prefix}.{alias}" if prefix else alias
    match = difflib.get_close_matches(word, accepted, n=1, cutoff=0.6)
    return match[0] if match else None


def _class_fields(class_path: str) -> list[str]:
    """Field or constructor argument names of the class a config entry names."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "args", "kwargs")]


def _parser_keys(parser) -> list[str]:
    """Every option key a (jsonargparse) parser accepts, dotted (``trainer.max_epochs``)."""
    keys = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", None)
        if dest and dest not in ("help", argparse.SUPPRESS) and not dest.startswith("_"):
            keys.append(dest)
    return keys


def _renamed_key(message: str) -> str | None:
    """'<old> is now <new>' when the parser refused a key that moved into a section."""
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    section = re.search(r'Parser key "([^"]+)": Unable to load config', message)
    flag = re.search(r"unrecognized arguments: --([^\s=]+)", message)
    key = (f"{group.group(1)}.{group.group(2)}" if group else section.group(1) if section
           else flag.group(1) if flag else None)
    new = RENAMED_KEYS.get(key) if key else None
    if new is None:
        return None
    return f"'{key}' is now '{new}' (a field of the '{new.rpartition('.')[0]}' section); "


def _usage_hint(message: str, parsers: dict, subcommand: str | None) -> str:
    """'did you mean ...' for the key or choice the parser refused, then where the full usage is."""
    prog = "lightning-lorafusion" + (f" {subcommand}" if subcommand else "")
    tail = f"'{prog} --help' lists every accepted option"
    renamed = _renamed_key(message)
    if renamed is not None:
        return renamed + tail
    suggestion = None
    refused = re.search(r"does not accept option '([^']+)'", message)
    unknown_field = re.search(r"Option '([^']+)' is not accepted", message)
    choice = re.search(r"invalid choice: '([^']+)' \(choose from (.*)\)", message)
    unrecognized = re.search(r"unrecognized arguments: --([^\s=]+)", message)
    if unknown_field:
        owner = re.search(r"class_path '([^']+)'", message)
        fields = _class_fields(owner.group(1)) if owner else []
        key = re.search(r'Parser key "([^"]+)"', message)
        match = _suggest(unknown_field.group(1), fields)
        if match is not None:
            where = f" ({key.group(1)}[].{match})" if key and "adapters" in key.group(1) else ""
            suggestion = f"'{match}'{where}"
    elif refused and subcommand in parsers:
        match = _suggest(refused.group(1), _parser_keys(parsers[subcommand]))
        suggestion = f"'{match}'" if match else None
    elif unrecognized and subcommand in parsers:
        match = _suggest(unrecognized.group(1), _parser_keys(parsers[subcommand]))
        suggestion = f"'--{match}'" if match else None
    elif choice:
        options = re.findall(r"'([^']+)'", choice.group(2))
        match = _suggest(choice.group(1), options)
        suggestion = f"'{match}'" if match else None
    return (f"did you mean {suggestion}? " if suggestion else "") + tail


class LoRAFusionCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's subcommands but ``predict``: the module has no ``predict_step``."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def parse_arguments(self, parser, args) -> None:
        """Parse, turning the parser's refusal into a one-line ``UsageError`` with a hint."""
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            argv = list(sys.argv[1:] if args is None else args)
            parsers = getattr(self, "_subcommand_parsers", {})
            subcommand = next((a for a in argv if a in parsers), None)
            message = " ".join(str(error).split())
            raise UsageError(message, _usage_hint(str(error), parsers, subcommand)) from None

    def instantiate_classes(self) -> None:
        """Build the configured classes. A class's own refusal (a ``ConfigError`` of, say, the
        strategy's ``__init__``) reaches us from jsonargparse as a ValueError listing each type it
        tried; that refusal becomes the one-line ``ConfigError`` it was."""
        try:
            super().instantiate_classes()
        except ValueError as error:
            refusals = [line.strip()[2:] for line in str(error).splitlines()
                        if line.strip().startswith("- ") and not line.strip().startswith("- Expected a ")]
            if "Does not validate against any of the Union subtypes" in str(error) and refusals:
                raise ConfigError("; ".join(refusals)) from None
            raise

    def _parse_ckpt_path(self) -> None:
        """With ``--ckpt_path``, check the config's model section against the checkpoint's (a
        mismatch is a ``ConfigError`` naming the field). Lightning's own version would replace the
        config's model section with the checkpoint's, silently, so a config that does not fit
        the checkpoint could never be noticed; here the config given is the one used."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).is_file():
            return  # "last"/"best" or a missing file: Lightning resolves or refuses it
        import torch

        from .training.resume_check import check_checkpoint_config

        checkpoint = torch.load(ckpt_path, weights_only=True, map_location="cpu", mmap=True)
        check_checkpoint_config(checkpoint.get("hyper_parameters"), self.config[subcommand]["model"],
                                model_class=LoRAFusionModule, stage=subcommand, log_changes=False)

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

    ``fit`` / ``validate`` / ``test`` (and ``--print_config``, ``--help``) go to LightningCLI; ``serve``
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
    expandable_segments_by_default(os.environ)  # before the first CUDA allocation (capture.py says why)
    _log_to_stderr()
    # parse errors raise (UsageError, one line) instead of printing the whole usage first
    quiet = {"exit_on_error": False}
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
                    **quiet,
                    "fit": {"default_config_files": [], **quiet},
                    "validate": quiet,
                    "test": quiet,
                },
            )
    except SystemExit as exit_:  # argparse: --help, --print_config
        return _exit_status(exit_.code)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        print(f"hint: {err.hint}", file=sys.stderr)
        return EXIT_USER
    except USER_ERRORS as err:
        return _report_user_error(err, debug)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
