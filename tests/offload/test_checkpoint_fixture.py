"""Checkpoints written by an earlier layout of the code still load, and training resumes the same way.

The fixtures under ``fixtures/checkpoint_v1`` were written by ``fixtures/make_checkpoints.py`` (see its
docstring) together with what loading them must give and the result of two more steps after resuming.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import batch_layers
import offload

HERE = Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location("_make_checkpoints", HERE / "make_checkpoints.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def assert_snapshot(got: dict, want: dict, *, trained: bool = False) -> None:
    """What loading gives, exactly; after training steps (``trained``), the tensors within a few float32
    roundings: torch's CPU optimizers round by the vector width of the machine that runs them (Adam's weight
    moved by one ulp on an AVX-512 machine against the one that wrote the fixture)."""

    def same(got_tensor: torch.Tensor, want_tensor: torch.Tensor) -> bool:
        if not trained:
            return torch.equal(got_tensor, want_tensor)
        return got_tensor.dtype == want_tensor.dtype and torch.allclose(got_tensor, want_tensor, rtol=1e-6, atol=1e-7)

    assert same(got["weight"], want["weight"])
    assert sorted(got["state"]) == sorted(want["state"])
    for k, v in want["state"].items():
        assert same(got["state"][k], v), k
    assert sorted(got["scalars"]) == sorted(want["scalars"])
    for k, v in want["scalars"].items():
        g = got["scalars"][k]
        assert (torch.equal(g, v) and g.dtype == v.dtype) if isinstance(v, torch.Tensor) else g == v, k


@pytest.mark.parametrize("mmap_mode", ["c", None])
def test_old_single_checkpoint_loads_and_resumes(mmap_mode):
    expected = torch.load(HERE / "checkpoint_v1/single/expected.pt", weights_only=True)
    emb = offload.OffloadedEmbedding.from_checkpoint(HERE / "checkpoint_v1/single/ckpt", mmap_mode=mmap_mode,
                                                     cache_rows=make.SINGLE["cache_rows"])
    assert emb.padding_idx == make.SINGLE["padding_idx"]
    opt = offload.attach(torch.optim.Adam(emb.parameters(), lr=make.SINGLE["lr"]))
    assert_snapshot(make.snapshot(emb, opt), expected["loaded"])
    make.train(emb, opt, make.single_steps(2, seed=2))
    assert_snapshot(make.snapshot(emb, opt), expected["resumed"], trained=True)


def test_old_batched_checkpoint_loads_and_resumes():
    b = make.BATCHED
    expected = torch.load(HERE / "checkpoint_v1/batched/expected.pt", weights_only=True)
    emb = batch_layers.Embedding(b["num"], b["dim"], batch=b["batch"], offload=True, cache_rows=b["cache_rows"])
    emb.load(HERE / "checkpoint_v1/batched/ckpt")
    opt = offload.attach(torch.optim.SGD(emb.parameters(), lr=b["lr"], momentum=b["momentum"]))
    assert_snapshot(make.snapshot(emb.offloaded, opt), expected["loaded"])
    make.train(emb, opt, make.batched_steps(2, seed=4))
    assert_snapshot(make.snapshot(emb.offloaded, opt), expected["resumed"], trained=True)


def test_old_batched_state_dict_loads():
    b = make.BATCHED
    expected = torch.load(HERE / "checkpoint_v1/batched/expected.pt", weights_only=True)
    sd = torch.load(HERE / "checkpoint_v1/batched/state_dict.pt", weights_only=True)
    emb = batch_layers.Embedding(b["num"], b["dim"], batch=b["batch"], offload=True, cache_rows=b["cache_rows"])
    emb.load_state_dict(sd)
    assert torch.equal(emb.state_dict()["weight"].reshape(-1, b["dim"]), expected["loaded"]["weight"])
