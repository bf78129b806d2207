"""The torchmb command line: ``python -m torchmb demo`` and ``python -m torchmb bench``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import __version__
from .cli import bench as _bench
from .cli import demo as _demo


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchmb", description="Train many PyTorch models at once.")
    parser.add_argument("--version", action="version", version=f"torchmb {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a learning-rate x weight-decay sweep of 64 small CNNs")
    _demo.add_arguments(demo)
    bench = commands.add_parser("bench", help="measure torchmb against torch.func.vmap, a loop and one plain model")
    _bench.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "demo":
        _demo.main(args)
    else:
        _bench.main(args)


if __name__ == "__main__":
    main()
