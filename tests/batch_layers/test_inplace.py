"""In-place ops on every registered layer's output (``ReLU(inplace=True)`` after a convolution, ``x += y``
after a norm), forward and backward, against B independent plain torch layers doing the same."""

from __future__ import annotations

import pytest
import torch
from support.layer_cases import BATCH, LAYER_CASES, LayerCase, _call, _reference_backend, run_case
from torch import Tensor, nn

from torchmb import BatchModule, lookup_batch_module

COMPARED = [case for case in LAYER_CASES if case.refuses is None]


def inplace_ops(y: Tensor) -> None:
    """``add_``, ``mul_`` and ``relu_`` in the order plain torch accepts after any layer (ReLU saves its result)."""
    y.add_(0.5).mul_(0.5).relu_()


def outputs_plain_torch_lets_change(case: LayerCase, mode: str, device: str = "cpu") -> list[bool]:
    """Which outputs of a plain layer may be changed in place before backward: plain torch refuses some
    (an RNN cell's ReLU output and attention weights are saved for backward), and so the test leaves those."""
    layer = case.make().to(device).train(mode == "train")
    inputs = [x[0].detach() for x in case.inputs(device)]

    def outputs() -> list[Tensor]:
        torch.manual_seed(0)
        with _reference_backend(layer):
            return _call(
                layer, case, [x.clone().requires_grad_().clone() if x.is_floating_point() else x for x in inputs]
            )

    def accepts(k: int) -> bool:
        ys = outputs()
        try:
            inplace_ops(ys[k])
            differentiable = [y for y in ys if y.requires_grad]
            with _reference_backend(layer):
                torch.autograd.backward(differentiable, [torch.ones_like(y) for y in differentiable])
        except RuntimeError as error:
            assert "inplace" in str(error), error
            return False
        return True

    return [accepts(k) for k in range(len(outputs()))]


def inplace_on(allowed: list[bool]):
    def then(outputs: list[Tensor]) -> None:
        for y, change in zip(outputs, allowed):
            if change and y.is_floating_point():
                inplace_ops(y)

    return then


CASES_AND_MODES = [pytest.param(case, mode, id=f"{case.name}-{mode}") for case in COMPARED for mode in case.modes]


@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize(("case", "mode"), CASES_AND_MODES)
def test_inplace_ops_on_a_batched_layers_output(case: LayerCase, mode: str, order: str) -> None:
    if not lookup_batch_module(type(case.make())).runs_in(order):
        pytest.skip(f"{case.name} runs models-major only")
    allowed = outputs_plain_torch_lets_change(case, mode)
    if not any(allowed):
        pytest.skip(f"plain torch refuses in-place ops on every output of {case.name} (it saves them for backward)")
    run_case(case, mode, "cpu", order=order, then=inplace_on(allowed))


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["models", "samples"])
@pytest.mark.parametrize(("case", "mode"), CASES_AND_MODES)
def test_inplace_ops_on_a_batched_layers_output_on_cuda(case: LayerCase, mode: str, order: str) -> None:
    """The CUDA paths: cuDNN's grouped convolutions, the embedding's kernels."""
    if not lookup_batch_module(type(case.make())).runs_in(order):
        pytest.skip(f"{case.name} runs models-major only")
    allowed = outputs_plain_torch_lets_change(case, mode, "cuda")
    if not any(allowed):
        pytest.skip(f"plain torch refuses in-place ops on every output of {case.name} (it saves them for backward)")
    run_case(case, mode, "cuda", order=order, then=inplace_on(allowed))


class InPlaceAfter(nn.Module):
    """A model: ``layer`` (a layer case's), then in-place ops on its outputs, each returned with its merged
    model axis moved to dim 0."""

    def __init__(self, layer: nn.Module, case: LayerCase, allowed: list[bool]) -> None:
        super().__init__()
        self.layer = layer
        self.case = case
        self.then = inplace_on(allowed)

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        outputs = _call(self.layer, self.case, [x.clone() if x.requires_grad else x for x in inputs])
        self.then(outputs)
        out_dims = self.case.out_dims or (0,) * len(outputs)
        return tuple(y.movedim(d, 0) for y, d in zip(outputs, out_dims))


@pytest.mark.parametrize(("case", "mode"), CASES_AND_MODES)
def test_inplace_ops_inside_a_batch_module(case: LayerCase, mode: str) -> None:
    """In the merged order a BatchModule picks for the layer (samples-major for convolutions and batch norms)."""
    allowed = outputs_plain_torch_lets_change(case, mode)
    torch.manual_seed(0)
    plain = [InPlaceAfter(case.make(), case, allowed).train(mode == "train") for _ in range(BATCH)]
    batched = BatchModule(InPlaceAfter(case.make(), case, allowed), BATCH)
    batched.load_state_dicts([model.state_dict() for model in plain])
    batched.train(mode == "train")
    inputs = [x.requires_grad_() if x.is_floating_point() else x for x in case.inputs("cpu")]
    outputs = batched(*inputs)
    grads = [torch.randn_like(y) for y in outputs]
    torch.autograd.backward(outputs, grads)
    params = dict(batched.module.named_parameters())
    for i, model in enumerate(plain):
        own = [x[i].detach().requires_grad_() if x.is_floating_point() else x[i] for x in inputs]
        own_outputs = model(*own)
        torch.autograd.backward(own_outputs, [g[i] for g in grads])
        for y, y_own in zip(outputs, own_outputs):
            torch.testing.assert_close(y[i], y_own, atol=case.atol, rtol=1e-6)
        for x, x_own in zip(inputs, own):
            if x_own.requires_grad:
                torch.testing.assert_close(x.grad[i], x_own.grad, atol=case.atol, rtol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(params[name].grad[i], param.grad, atol=case.atol, rtol=1e-6)
