"""Every registered batched layer against B independently held torch layers with different weights."""

from __future__ import annotations

import pytest
import torch
from support.layer_cases import LAYER_CASES, LayerCase, run_case

import batch_layers
from torchmb import lookup_batch_module

# Each case in the modes it is compared in (dropout-like layers are random in train mode; their masks
# have tests of their own, named by the case's skip_reason).
CASE_MODES = [pytest.param(case, mode, id=f"{case.name}-{mode}") for case in LAYER_CASES for mode in case.modes]


@pytest.mark.parametrize(("case", "mode"), CASE_MODES)
def test_layer_matches_independent_torch_layers(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize(("case", "mode"), CASE_MODES)
def test_layer_matches_independent_torch_layers_cuda(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cuda")


SAMPLES_MAJOR_MODES = [
    pytest.param(case, mode, id=f"{case.name}-{mode}")
    for case in LAYER_CASES
    for mode in case.modes
    if case.refuses is None and lookup_batch_module(type(case.make())).runs_in("samples")
]


@pytest.mark.parametrize(("case", "mode"), SAMPLES_MAJOR_MODES)
def test_layer_matches_independent_torch_layers_samples_major(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cpu", order="samples")


@pytest.mark.cuda
@pytest.mark.parametrize(("case", "mode"), SAMPLES_MAJOR_MODES)
def test_layer_matches_independent_torch_layers_samples_major_cuda(case: LayerCase, mode: str) -> None:
    run_case(case, mode, "cuda", order="samples")


def test_every_registered_layer_has_a_case() -> None:
    covered = {type(case.make()) for case in LAYER_CASES}
    missing = [layer.__name__ for layer in batch_layers.LAYERS if layer.base_class not in covered]
    assert not missing, f"no layer case for {missing}"


@pytest.mark.parametrize(
    ("batched_class", "args"),
    [(batch_layers.Linear, (4, 3)), (batch_layers.Conv2d, (2, 3, 3)), (batch_layers.Conv1d, (2, 4, 2))],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_reset_parameters_draws_like_b_torch_layers(batched_class, args) -> None:
    torch.manual_seed(0)
    batched = batched_class(*args, batch=5)
    torch.manual_seed(0)
    plain = [batched_class.base_class(*args) for _ in range(5)]
    for i, layer in enumerate(plain):
        for name, param in layer.named_parameters():
            assert torch.equal(getattr(batched, name)[i], param)
    assert not torch.equal(batched.weight[0], batched.weight[1])


def test_layer_refuses_input_without_model_axis() -> None:
    layer = batch_layers.Linear(4, 3, batch=3)
    with pytest.raises(ValueError, match=r"multiple of B = 3 \(the merged model axis\), got shape \(4, 4\)"):
        layer(torch.randn(4, 4))


def test_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch must be a positive int"):
        batch_layers.Linear(4, 3, batch=0)


def test_conv_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="divisible by groups"):
        batch_layers.Conv2d(3, 4, 3, groups=2, batch=2)
    with pytest.raises(ValueError, match="padding_mode"):
        batch_layers.Conv2d(3, 4, 3, padding_mode="mirror", batch=2)
    with pytest.raises(ValueError, match="strided"):
        batch_layers.Conv2d(3, 4, 3, stride=2, padding="same", batch=2)


def test_batchnorm_refuses_wrong_rank() -> None:
    with pytest.raises(ValueError, match="expected a 4-D input, got shape"):
        batch_layers.BatchNorm2d(3, batch=2)(torch.randn(4, 3))
