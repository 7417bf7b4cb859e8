"""The ``liger-portable`` command line.

Arguments are parsed before torch is imported, so ``--help`` and argument errors answer at once;
an error of the platform (an unknown or absent ``LIGER_PORTABLE_BACKEND``), of another setting
(``LIGER_PORTABLE_UNDER_COMPILE``) or of a config table is one line on stderr and exit status 2;
Ctrl-C is one line and exit status 130 (:func:`liger_portable._arguments.run_reported`, which
``python -m liger_portable.warmup`` / ``.demo`` and ``scripts/autotune_warmup.py`` run through too).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from ._arguments import DEMO_DESCRIPTION, WARMUP_DESCRIPTION, demo_arguments, run_reported, warmup_arguments

DESCRIPTION = "Fused Triton kernels for LLM training, with launch configs per GPU vendor and model."


def _device_index(text: str) -> int:
    """An argparse type: a GPU index, a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a GPU index (a whole number >= 0), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liger-portable", description=DESCRIPTION, epilog="`liger-portable COMMAND -h` shows a command's options."
    )
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="the detected backend and devices, and where each kernel's config comes from")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    check = sub.add_parser("check", help="run every kernel on this machine against the float64 PyTorch fallback")
    check.add_argument("--device", type=_device_index, default=0, help="GPU index (default 0; ignored without a GPU)")
    warmup_arguments(sub.add_parser(
        "warmup", help="tune the kernel problems of one training step of a model",
        description=WARMUP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    demo_arguments(sub.add_parser(
        "demo", help="train a small Llama-style model with and without the kernels", description=DEMO_DESCRIPTION,
    ))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # torch and the package are imported from here on. Without NumPy (not a dependency) torch warns
    # at import that it cannot initialise it; nothing here needs it.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    return run_reported(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if args.command == "warmup":
        from . import warmup

        return warmup.run_command(args)
    if args.command == "demo":
        from . import demo

        return demo.run_command(args)
    from . import commands

    return commands.cmd_info(args) if args.command == "info" else commands.cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
