"""One training step of a BatchModule compiled with Inductor against B plain models, run as a script in a fresh
process (``python -m support.inductor_check MODEL ORDER``), so that no earlier compile, cache or thread setting
of a test session decides how Inductor fuses. Exits non-zero, naming what differs, when a number does.

MODEL is a key of :data:`MODELS`; ORDER is ``auto``, ``samples`` or ``models`` (``auto`` must settle on
samples-major for these models, which the script checks)."""

from __future__ import annotations

import sys

import torch
from support.models import BatchNormCNN, LeNet

from torchmb import BatchModule

B, N = 2, 3
MODELS = {"lenet": (LeNet, (1, 28, 28)), "batchnorm_cnn": (BatchNormCNN, (3, 8, 8))}


def check(model: str, order: str) -> None:
    make, shape = MODELS[model]
    torch.manual_seed(0)
    plain = [make() for _ in range(B)]
    batched = BatchModule(make(), B, merged_order=order)
    batched.load_state_dicts([m.state_dict() for m in plain])
    x = torch.randn(B, N, *shape)
    compiled = torch.compile(batched, backend="inductor", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    assert batched.merged_order == ("samples" if order == "auto" else order), batched.merged_order
    grads = dict(batched.named_parameters())
    for i, model_i in enumerate(plain):
        want = model_i(x[i])
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-4, msg=f"model {i}'s output")
        for name, p in model_i.named_parameters():
            got = grads[f"module.{name}"].grad[i]
            torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4, msg=f"model {i}'s gradient of {name}")
    for i, model_i in enumerate(plain):  # batch norm's running statistics, updated once
        for (key, want), got in zip(model_i.state_dict().items(), batched.state_dicts()[i].values(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"model {i}'s {key}")


if __name__ == "__main__":
    check(*sys.argv[1:])
    print("same as plain models")
