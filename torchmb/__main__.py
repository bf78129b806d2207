"""The torchmb command line: ``python -m torchmb demo``, ``bench``, ``kernels`` and ``config``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torchmb_config

from . import __version__
from .cli import bench as _bench
from .cli import demo as _demo
from .cli import kernels as _kernels


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchmb", description="Train many PyTorch models at once.")
    parser.add_argument("--version", action="version", version=f"torchmb {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a learning-rate x weight-decay sweep of 64 small CNNs")
    _demo.add_arguments(demo)
    bench = commands.add_parser("bench", help="measure torchmb against torch.func.vmap, a loop and one plain model")
    _bench.add_arguments(bench)
    kernels = commands.add_parser("kernels", help="which kernel a batched 2-D convolution takes, and why")
    _kernels.add_arguments(kernels)
    commands.add_parser("config", help="every switch, its environment variable and its value now")
    args = parser.parse_args(argv)
    if args.command == "demo":
        _demo.main(args)
    elif args.command == "bench":
        _bench.main(args)
    elif args.command == "kernels":
        _kernels.main(args)
    else:
        print(torchmb_config.describe())


if __name__ == "__main__":
    main()
