"""The plain-torch net on which torch 2.13's Inductor gave zero convolution gradients (pytorch/pytorch#185509), run as
a script in a fresh process (``python -m support.inductor_scatter_net [--unfixed]``) on one CPU thread: B=2
convolutional nets made one by grouped convolutions and batched products over samples-major rows, as a
samples-major BatchModule runs LeNet. Its backward scatters ``max_pool2d``'s gradient into a zero buffer; the
kernel Inductor fused from the ``threshold_backward`` after it read that buffer before the scatter. Exits
non-zero, naming the gradient, when the compiled gradients differ from eager; ``--unfixed`` leaves out
``torchmb._inductor_fixes`` (to see the bug on a torch that has it)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from torchmb._inductor_fixes import keep_scatter_order_in_inductor

B, N = 2, 3


class Conv(torch.autograd.Function):  # B convolutions as one grouped one
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.convolution(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], B)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.ops.aten.convolution_backward(g, x, w, [w.shape[0]], [1, 1], [0, 0], [1, 1], False, [0, 0], B,
                                                   [True, True, True])


class Linear(torch.autograd.Function):  # B linears as one batched product
    @staticmethod
    def forward(ctx, rows, w, b):
        ctx.save_for_backward(rows, w)
        return torch.bmm(rows, w.transpose(1, 2)) + b.unsqueeze(1)

    @staticmethod
    def backward(ctx, g):
        rows, w = ctx.saved_tensors
        g = g.contiguous()
        return torch.bmm(g, w), torch.bmm(g.transpose(1, 2), rows), g.sum(1)


def linear(x, w, b):  # x: (N*B, in), samples-major rows
    y = Linear.apply(x.reshape(N, B, -1).transpose(0, 1), w, b)
    return y.transpose(0, 1).reshape(N * B, -1)


def nets(x, w1, b1, w2, b2, w3, b3, w4, b4, w5, b5):
    y = Conv.apply(x.transpose(0, 1).reshape(N, B, 28, 28), w1.reshape(12, 1, 5, 5), b1.reshape(-1))
    y = F.max_pool2d(F.relu(y.reshape(N * B, 6, 24, 24)), 2)
    y = Conv.apply(y.reshape(N, B * 6, 12, 12), w2.reshape(32, 6, 5, 5), b2.reshape(-1))
    y = F.max_pool2d(F.relu(y.reshape(N * B, 16, 8, 8)), 2).flatten(1)
    y = linear(F.relu(linear(F.relu(linear(y, w3, b3)), w4, b4)), w5, b5)
    return y.view(N, B, -1).transpose(0, 1).contiguous()


def main(fixed: bool) -> None:
    if fixed:
        keep_scatter_order_in_inductor()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = [(B, 6, 1, 5, 5), (B, 6), (B, 16, 6, 5, 5), (B, 16), (B, 120, 256), (B, 120), (B, 84, 120), (B, 84),
              (B, 10, 84), (B, 10)]
    params = [(0.1 * torch.randn(s)).requires_grad_() for s in shapes]
    x = torch.randn(B, N, 1, 28, 28)
    want = torch.autograd.grad(nets(x, *params).square().sum(), params)
    got = torch.autograd.grad(torch.compile(nets, backend="inductor")(x, *params).square().sum(), params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"gradient of parameter {i}, shape {tuple(w.shape)}")


if __name__ == "__main__":
    main(fixed="--unfixed" not in sys.argv[1:])
    print("same as eager")
