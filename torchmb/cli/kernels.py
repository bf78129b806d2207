"""``python -m torchmb kernels``: which kernel a batched 2-D convolution of a given shape takes for each op,
and why not the ones preferred before it (the kernel table of ``batch_layers``)."""

from __future__ import annotations

import argparse

import torch

from batch_layers import explain_kernels

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, required=True, help="number of models B")
    parser.add_argument("--in-channels", type=int, required=True, help="input channels of one model's layer")
    parser.add_argument("--out-channels", type=int, required=True, help="output channels of one model's layer")
    parser.add_argument("--kernel", type=int, nargs=2, default=(3, 3), metavar=("KH", "KW"),
                        help="kernel height and width (default 3 3)")
    parser.add_argument("--groups", type=int, default=1, help="groups of one model's layer (default 1)")
    parser.add_argument("--stride", type=int, default=1, help="stride (default 1)")
    parser.add_argument("--dilation", type=int, default=1, help="dilation (default 1)")
    parser.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                        help="the input image's height and width (the matrix products need it)")
    parser.add_argument("--padding", type=int, default=0, help="zero padding on each side (default 0)")
    parser.add_argument("--transposed", action="store_true", help="a transposed convolution (ConvTranspose2d)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="input dtype (default float32)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the input's device type (default cuda: every kernel but ATen's needs it)")


def main(args: argparse.Namespace) -> str:
    b, c, o, g = args.batch, args.in_channels, args.out_channels, args.groups
    for name, value in (("batch", b), ("in-channels", c), ("out-channels", o), ("groups", g)):
        if value < 1:
            raise SystemExit(f"--{name} must be at least 1, got {value}")
    if c % g or o % g:
        raise SystemExit(f"--in-channels ({c}) and --out-channels ({o}) must be divisible by --groups ({g})")
    kh, kw = args.kernel
    weight = (b * c, o // g, kh, kw) if args.transposed else (b * o, c // g, kh, kw)
    text = explain_kernels(cuda=args.device == "cuda", dims=4, dtype=_DTYPES[args.dtype], channels=b * c,
                           weight_shape=weight, groups=b * g, transposed=args.transposed,
                           stride=(args.stride,) * 2, dilation=(args.dilation,) * 2, size=tuple(args.size or ()),
                           padding=(args.padding,) * 2 if args.size else ())
    image = f", {args.size[0]}x{args.size[1]} images, padding {args.padding}" if args.size else ""
    print(f"B={b} models of a {'transposed ' if args.transposed else ''}{c} -> {o} channel {kh}x{kw} convolution "
          f"(groups={g}, stride {args.stride}, dilation {args.dilation}{image}, {args.dtype} on {args.device}): one "
          f"grouped convolution with weight {weight} and {b * g} groups")
    print(text)
    return text
