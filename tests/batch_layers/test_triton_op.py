"""The registration of torchmb's Triton-backed operators (``batch_layers/_triton_op.py``): whole in eager calls
and where a graph is kept for export, decomposed into their bodies when AOTAutograd functionalises a compiled
graph (so that Inductor sees the kernels' launches). The CUDA side, Inductor launching the real kernels, is
``test_conv_triton.py``'s."""

from __future__ import annotations

import pytest
import torch
from support.compiled import DYNAMO_WARNINGS, aot_graphs_backend, fresh_dynamo
from torch import Tensor

from batch_layers._triton_op import DECOMPOSED, launchable, triton_custom_op

pytestmark = [*DYNAMO_WARNINGS, pytest.mark.usefixtures("fresh_dynamo")]

__all__ = ["fresh_dynamo"]  # a fixture the tests use

if not DECOMPOSED:
    pytest.skip("this torch lacks wrap_triton or is_exporting: the operators stay opaque", allow_module_level=True)


def _affine_shaped(x: Tensor, scale: float) -> Tensor:
    return torch.empty_like(x)


BODY_RUNS: list[str] = []


@triton_custom_op("torchmb_test::scaled_plus_one", fake=_affine_shaped)
def scaled_plus_one(x: Tensor, scale: float) -> Tensor:
    """A stand-in body of ATen operators only (a real one launches a Triton kernel, which needs a GPU)."""
    BODY_RUNS.append(type(x).__name__)
    return x * scale + 1


def _post_aot_targets(fn, *args) -> tuple[Tensor, list[str]]:
    """``fn(*args)`` compiled, and the operators of the forward graph AOTAutograd hands the backend."""
    targets: list[str] = []

    def record(graph) -> None:
        targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")

    return torch.compile(fn, backend=aot_graphs_backend(record), fullgraph=True)(*args), targets


def test_eager_call_runs_the_body_once_and_matches_it() -> None:
    x = torch.randn(5)
    BODY_RUNS.clear()
    torch.testing.assert_close(scaled_plus_one(x, 3.0), x * 3 + 1)
    assert BODY_RUNS == ["Tensor"]


def test_compiled_graph_holds_the_body_in_place_of_the_operator() -> None:
    x = torch.randn(5)
    y, targets = _post_aot_targets(lambda t: scaled_plus_one(t.sin(), 2.0), x)
    torch.testing.assert_close(y, x.sin() * 2 + 1)
    assert "aten.mul.Tensor" in targets and "aten.add.Tensor" in targets, targets
    assert not [t for t in targets if "torchmb_test" in t], f"the operator should be decomposed: {targets}"


# torch's own export code, on torch 2.13
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
def test_exported_program_keeps_the_operator_whole_through_its_decompositions() -> None:
    """An exported program is meant to be serialised: it holds the operator, not a Triton kernel's source."""

    class Scaled(torch.nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return scaled_plus_one(x, 2.0)

    exported = torch.export.export(Scaled(), (torch.randn(5),))
    for program in (exported, exported.run_decompositions()):
        targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
        assert targets == ["torchmb_test.scaled_plus_one.default"], targets


def test_launchable_is_the_kernel_itself_outside_a_traced_body() -> None:
    kernel = object()  # eager, no wrapping: a real kernel is launched as it is
    assert launchable(kernel) is kernel


def test_compiled_tensor_subclass_reaches_the_body_as_its_inner_tensors() -> None:
    """A subclass (here torch's test ``TwoTensor``) unwraps before the body is traced: a real body hands its
    tensors to a Triton launch, which takes plain tensors only."""
    from torch.testing._internal.two_tensor import TwoTensor

    first, second = torch.randn(5), torch.randn(5)
    BODY_RUNS.clear()
    y = torch.compile(lambda t: scaled_plus_one(t, 2.0), backend="aot_eager", fullgraph=True)(TwoTensor(first, second))
    assert isinstance(y, TwoTensor)
    torch.testing.assert_close(y.a, first * 2 + 1)
    torch.testing.assert_close(y.b, second * 2 + 1)
    assert BODY_RUNS and set(BODY_RUNS) == {"FunctionalTensor"}, BODY_RUNS


@pytest.mark.parametrize(
    ("kernel", "x_shape", "grad_shape", "weight_shape", "stride", "padding", "groups"),
    [("grouped", (0, 4 * 3, 9, 9), (0, 4 * 8, 5, 5), [4 * 8, 3, 7, 7], [2, 2], [3, 3], 4),  # 4 models' 7x7 stems
     ("depthwise", (0, 6, 9, 9), (0, 6, 9, 9), [6, 1, 3, 3], [1, 1], [1, 1], 6)],
    ids=["grouped", "depthwise"],
)
def test_the_weight_gradient_kernels_of_no_samples_are_zeros(kernel, x_shape, grad_shape, weight_shape, stride,
                                                               padding, groups) -> None:
    """An empty batch leaves no output position to share among programs: the weight gradient is zero, as
    ``torch.convolution``'s is, without a launch (the grid would divide by zero)."""
    from batch_layers._conv_triton import grouped_weight_grad
    from batch_layers._depthwise_triton import depthwise_weight_grad

    x, grad = torch.empty(x_shape), torch.empty(grad_shape)
    if kernel == "grouped":
        weight_grad = grouped_weight_grad(grad, x, weight_shape, stride, padding, [1, 1], groups)
    else:
        weight_grad = depthwise_weight_grad(grad, x, weight_shape, stride, padding, [1, 1])
    plain = torch.ops.aten.convolution_backward(grad, x, torch.empty(weight_shape), None, stride, padding, [1, 1],
                                                False, [0, 0], groups, [False, True, False])[1]
    assert weight_grad.shape == plain.shape and not weight_grad.any() and not plain.any()


@pytest.mark.parametrize(("positions", "parallel"), [(1, 1), (100, 3), (32768, 48), (32768, 192), (1 << 20, 4096)])
def test_position_shares_cover_every_position_once_in_whole_blocks(positions: int, parallel: int) -> None:
    from batch_layers._triton_op import position_shares

    block, programs = 64, 528
    shares, chunk = position_shares(positions, block, programs, parallel)
    assert chunk % block == 0 and (shares - 1) * chunk < positions <= shares * chunk, "each position in one share"
    assert shares == 1 or shares * parallel <= programs + parallel, "no more programs than asked for, to a share"
    assert shares == 1 or chunk >= 8 * block, "shares of at least eight blocks"
