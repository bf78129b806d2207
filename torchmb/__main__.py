"""The torchmb command line: ``python -m torchmb demo``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import _demo


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchmb", description="Train many PyTorch models at once.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a batch of small CNNs and report each one's accuracy")
    _demo.add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        _demo.main(args)


if __name__ == "__main__":
    main()
