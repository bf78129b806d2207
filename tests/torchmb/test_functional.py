from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchmb import batch_accuracy, batch_loss, batch_topk, merge_batch, split_batch

B, N, C = 4, 9, 6


@pytest.fixture
def data():
    torch.manual_seed(0)
    return torch.randn(B, N, C, requires_grad=True), torch.randint(0, C, (B, N))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_batch_loss_equals_each_models_own_loss(data, reduction: str) -> None:
    outputs, targets = data
    targets = targets.clone()
    targets[0, :3] = -100  # ignored positions must leave the mean's denominator, as in torch
    losses = batch_loss(outputs, targets, F.cross_entropy, reduction)
    expected = torch.stack([F.cross_entropy(outputs[i], targets[i], reduction=reduction) for i in range(B)])
    torch.testing.assert_close(losses, expected)
    losses.sum().backward()
    grad = outputs.grad.clone()
    outputs.grad = None
    expected.sum().backward()
    torch.testing.assert_close(grad, outputs.grad)


def test_batch_loss_legacy_call_form_and_keywords(data) -> None:
    outputs, targets = data
    legacy = batch_loss(outputs, targets, B, F.cross_entropy, "mean")
    keywords = batch_loss(outputs, targets, loss_fn=F.cross_entropy, reduction="mean", label_smoothing=0.0)
    expected = torch.stack([F.cross_entropy(outputs[i], targets[i]) for i in range(B)])
    torch.testing.assert_close(legacy, expected)
    torch.testing.assert_close(keywords, expected)
    with pytest.raises(ValueError, match="batch=3 but outputs have 4 models"):
        batch_loss(outputs, targets, 3, F.cross_entropy, "mean")


def test_batch_loss_shared_targets_and_other_losses(data) -> None:
    outputs, targets = data
    shared = targets[0]
    torch.testing.assert_close(
        batch_loss(outputs, shared), torch.stack([F.cross_entropy(outputs[i], shared) for i in range(B)])
    )
    regression_target = torch.randn(B, N, C)
    torch.testing.assert_close(
        batch_loss(outputs, regression_target, F.mse_loss, "sum"),
        torch.stack([F.mse_loss(outputs[i], regression_target[i], reduction="sum") for i in range(B)]),
    )


def test_batch_loss_refuses_bad_input(data) -> None:
    outputs, targets = data
    with pytest.raises(ValueError, match="reduction must be"):
        batch_loss(outputs, targets, F.cross_entropy, "avg")
    with pytest.raises(ValueError, match=r"targets of shape \(5,\) match neither"):
        batch_loss(outputs, torch.zeros(5, dtype=torch.long))


def test_batch_topk_equals_per_model_topk(data) -> None:
    outputs, targets = data
    accuracies = batch_topk(outputs, targets, k=(1, 3))
    assert accuracies.shape == (2, B)
    for i in range(B):
        for row, k in enumerate((1, 3)):
            top = outputs[i].topk(k, dim=1).indices
            expected = (top == targets[i, :, None]).any(1).float().mean()
            assert accuracies[row, i] == expected
    legacy = batch_topk(outputs, targets, B, (1, 3))
    assert torch.equal(legacy, accuracies)
    assert torch.equal(batch_accuracy(outputs, targets), accuracies[0])
    assert torch.equal(batch_topk(outputs, targets[0], k=1)[0], batch_accuracy(outputs, targets[0].expand(B, N)))


def test_batch_topk_dense_predictions() -> None:
    outputs = torch.randn(2, 3, 5, 4, 4)  # segmentation: classes along dim 2
    targets = torch.randint(0, 5, (2, 3, 4, 4))
    expected = torch.stack([(outputs[i].argmax(1) == targets[i]).float().mean() for i in range(2)])
    torch.testing.assert_close(batch_accuracy(outputs, targets), expected)


def test_batch_topk_refuses_k_beyond_classes(data) -> None:
    outputs, targets = data
    with pytest.raises(ValueError, match=r"every k must be in 1..6"):
        batch_topk(outputs, targets, k=(1, 7))


def test_merge_and_split_are_inverse() -> None:
    x = torch.randn(B, N, 3)
    merged = merge_batch(x)
    assert merged.shape == (B * N, 3)
    assert torch.equal(merged[N : 2 * N], x[1]), "models-major: model 1's samples follow model 0's"
    assert torch.equal(split_batch(merged, B), x)
    with pytest.raises(ValueError, match="not a multiple of batch=5"):
        split_batch(merged, 5)


def test_batch_loss_names_class_targets_out_of_range(data) -> None:
    outputs, targets = data
    with pytest.raises(IndexError):
        F.cross_entropy(outputs[0].detach(), targets[0] + C)  # torch refuses one model's too
    bad = targets.clone()
    bad[2, 1] = C + 1
    bad[0, 0] = -100  # ignore_index stays allowed
    with pytest.raises(ValueError, match=r"class targets must lie in \[0, C\) = \[0, 6\).*got \[7\] for models \[2\]"):
        batch_loss(outputs, bad)
    with pytest.raises(ValueError, match=r"got \[-1\] for models all \(shared targets\)"):
        batch_loss(outputs, torch.full((N,), -1))


def test_batch_loss_names_transposed_targets(data) -> None:
    outputs, targets = data
    expected = r"must be \(B, n, ...\) = \(4, 9\) .* or \(n, ...\) = \(9,\) shared .*got \(9, 4\)"
    with pytest.raises(ValueError, match=expected):
        batch_loss(outputs, targets.T.contiguous())


def test_batch_accuracy_refuses_targets_out_of_range(data) -> None:
    outputs, targets = data
    with pytest.raises(ValueError, match=r"class targets must lie in \[0, C\) = \[0, 6\).*got \[9, 10, 11\]"):
        batch_accuracy(outputs, torch.where(targets > 2, targets + C, targets))
    torch.testing.assert_close(
        batch_accuracy(outputs, targets),
        torch.stack([(outputs[i].argmax(1) == targets[i]).float().mean() for i in range(B)]),
    )
