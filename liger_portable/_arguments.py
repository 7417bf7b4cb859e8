"""The arguments of the ``warmup`` and ``demo`` commands, declared without importing torch: the
command line (:mod:`liger_portable.cli`) parses them before anything heavy is imported, so their
``-h`` and argument errors answer at once; ``python -m liger_portable.warmup``,
``scripts/autotune_warmup.py`` and ``python -m liger_portable.demo`` parse with the same declarations."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

WARMUP_DESCRIPTION = "Autotune warmup: tune every kernel problem of one training step and write the autotune cache."
DEMO_DESCRIPTION = "liger-portable demo: train a small Llama-style model with and without liger-portable."
# dtype names the commands accept -> torch dtype attribute
WARMUP_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                 "float32": "float32", "fp32": "float32"}
DEMO_DTYPES = ("bfloat16", "float16", "float32")


def at_least_one(name: str | None = None):
    """An argparse type: an integer >= 1; anything else is one error line (exit status 2) that
    names ``name`` where given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{name} must be at least 1, got {value}" if name else f"expected a whole number >= 1, got {value}"
            )
        return value

    return parse


_positive = at_least_one()


def warmup_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the arguments of ``liger-portable warmup`` on ``ap``."""
    from ._warmup import PRESETS  # model shapes only: no torch

    ap.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json (or its folder)")
    ap.add_argument("--tokens", type=_positive, nargs="+", default=[8192], help="tokens per step on one rank (default 8192)")
    ap.add_argument("--seq-len", type=_positive, default=4096, help="sequence length; capped at --tokens (default 4096)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=sorted(WARMUP_DTYPES), help="input dtypes (default bfloat16)")
    ap.add_argument("--loss", default="fused_linear_cross_entropy", choices=["fused_linear_cross_entropy", "cross_entropy"],
                    help="the loss the step runs (default fused_linear_cross_entropy: the logits are never built)")
    ap.add_argument("--fused-add-norm", action="store_true", help="the layers use the fused residual-add RMSNorm")
    ap.add_argument("--dry-run", action="store_true", help="list the problems, tune nothing (no GPU needed)")
    ap.add_argument("--json", action="store_true", help="print the list / results as JSON")
    return ap


def warmup_parser() -> argparse.ArgumentParser:
    """The parser of ``liger-portable warmup`` on its own (``python -m liger_portable.warmup``)."""
    return warmup_arguments(argparse.ArgumentParser(
        prog="liger-portable warmup", description=WARMUP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    ))


def demo_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the arguments of ``liger-portable demo`` on ``ap``."""
    ap.add_argument("--steps", type=at_least_one("--steps"), default=None, help="training steps per run (default 20 on a GPU, 10 on the CPU)")
    ap.add_argument("--device", default=None, help="torch device, e.g. cuda:1 or cpu (default: the detected GPU, else cpu)")
    ap.add_argument("--dtype", choices=sorted(DEMO_DTYPES), default=None, help="weight dtype (default bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON (progress still goes to stderr)")
    return ap



def demo_parser() -> argparse.ArgumentParser:
    """The parser of ``liger-portable demo`` on its own (``python -m liger_portable.demo``)."""
    return demo_arguments(argparse.ArgumentParser(prog="liger-portable demo", description=DEMO_DESCRIPTION))


def run_reported(run: Callable[[], int]) -> int:
    """``run()``'s exit status, the package's errors of setting reported as the command line reports
    them: a platform error (an unknown or absent ``LIGER_PORTABLE_BACKEND``), another bad setting
    (``LIGER_PORTABLE_UNDER_COMPILE``) or a malformed config table is one line on stderr and status
    2; Ctrl-C is one line and status 130. Every entry point (``liger-portable``, ``python -m
    liger_portable.warmup`` / ``.demo``, ``scripts/autotune_warmup.py``) runs through it."""
    # Imported here: the arguments parse before torch is imported.
    from ._checks import SettingError
    from .configs import ConfigError
    from .hardware import PlatformError

    try:
        return run()
    except (PlatformError, ConfigError, SettingError) as e:
        print(f"liger-portable: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("liger-portable: interrupted", file=sys.stderr)
        return 130
