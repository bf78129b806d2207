"""torchmb_config: every switch of the three packages, its environment variable, and the packages' own
switch functions reading it."""

from __future__ import annotations

import pytest
import torch
from support.compiled import fresh_dynamo  # noqa: F401 (a fixture)

import batch_layers
import offload
import torchmb_config
from batch_layers import _conv_triton, _depthwise_triton


def test_every_switch_is_documented_with_its_environment_variable():
    doc = torchmb_config.__doc__
    table = torchmb_config.describe()
    for switch in torchmb_config.SWITCHES.values():
        assert f"``{switch.name}`` (``{switch.env}``" in doc
        assert switch.name in table and switch.env in table and switch.doc in table


def test_set_returns_the_old_value_and_use_restores_it():
    before = torchmb_config.get("backend")
    with torchmb_config.use("backend", "TORCH") as now:
        assert now == "torch" and batch_layers.get_backend() == "torch"
        assert torchmb_config.set("backend", "cupy") == "torch"
        assert batch_layers.get_backend() == "cupy"
    assert torchmb_config.get("backend") == before == batch_layers.get_backend()


def test_the_packages_switch_functions_are_the_config_switches():
    with offload.use_engine("cpu"):
        assert torchmb_config.get("offload_engine") == "cpu"
    with torchmb_config.use("offload_engine", "uva"):
        assert offload.get_engine() == "uva"
    with offload.use_cache_kernels(False):
        assert torchmb_config.get("offload_cache_kernels") is False
    with torchmb_config.use("offload_cache_kernels", True):
        assert offload.get_cache_kernels() is True


def test_bad_values_are_refused_naming_the_choices(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'cupy', 'torch'\), got 'triton'"):
        torchmb_config.set("backend", "triton")
    with pytest.raises(ValueError, match="offload engine must be one of"):
        torchmb_config.set("offload_engine", "gpu")
    with pytest.raises(KeyError, match="no switch named 'kernels'; the switches are"):
        torchmb_config.get("kernels")
    switch = torchmb_config.SWITCHES["triton"]
    monkeypatch.setenv("TORCHMB_TRITON", "yes")
    with pytest.raises(ValueError, match="TORCHMB_TRITON='yes' is not valid for the 'triton' switch: expected 0 or 1"):
        switch.from_env()
    monkeypatch.setenv("TORCHMB_TRITON", "0")
    assert switch.from_env() is False
    monkeypatch.setenv("TORCHMB_OFFLOAD_ENGINE", "nope")
    with pytest.raises(ValueError, match="TORCHMB_OFFLOAD_ENGINE='nope'"):
        torchmb_config.SWITCHES["offload_engine"].from_env()


def test_a_bad_environment_variable_is_refused_at_the_first_use_and_a_set_value_replaces_it(monkeypatch):
    monkeypatch.setenv("TORCHMB_TEST_FLAG", "yes")
    switch = torchmb_config.Switch("test_flag", "TORCHMB_TEST_FLAG", True, "a test's", torchmb_config._flag, bool)
    for _ in range(2):
        with pytest.raises(ValueError, match="TORCHMB_TEST_FLAG='yes' is not valid for the 'test_flag' switch"):
            switch.get()
    with switch.use(False):
        assert switch.get() is False
    with pytest.raises(ValueError, match="TORCHMB_TEST_FLAG='yes'"):  # use() restores the state it found
        switch.get()
    switch.set(False)
    assert switch.get() is False


def test_the_environment_is_read_when_the_switch_is_made_not_at_its_first_use(monkeypatch):
    monkeypatch.setenv("TORCHMB_TEST_FLAG", "0")
    switch = torchmb_config.Switch("test_flag", "TORCHMB_TEST_FLAG", True, "a test's", torchmb_config._flag, bool)
    monkeypatch.setenv("TORCHMB_TEST_FLAG", "1")
    assert switch.get() is False


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo's own
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_switch_read_inside_an_autograd_function_compiles_without_a_graph_break(monkeypatch):
    """Reading a switch changes nothing, so torch.compile traces it inside an autograd function's backward
    (the kernel table reads the 'triton' switch there; a first read that cached the value broke the graph)."""
    monkeypatch.setenv("TORCHMB_TEST_FLAG", "1")
    switch = torchmb_config.Switch("test_flag", "TORCHMB_TEST_FLAG", False, "a test's", torchmb_config._flag, bool)

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 if switch.get() else grad

    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: Doubled.apply(t).sum(), backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_launcher_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert torchmb_config.launcher_environment() == torchmb_config.LauncherEnvironment(None, None, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torchmb_config.launcher_environment().world_size is None  # (RANK missing: not launched)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchmb_config.launcher_environment() == torchmb_config.LauncherEnvironment(4, 3, 1)


@pytest.mark.cuda
def test_triton_switch_keeps_convolutions_off_the_triton_kernels():
    pytest.importorskip("triton")
    x = torch.randn(2, 256, 8, 8, device="cuda")
    grouped = torch.randn(512, 2, 3, 3, device="cuda")  # 128 groups of 4 outputs, 2 inputs each
    depthwise = torch.randn(256, 1, 7, 7, device="cuda")
    assert _conv_triton.runs_on_triton(x, grouped, 128, False)
    with torchmb_config.use("triton", False):
        assert not _conv_triton.runs_on_triton(x, grouped, 128, False)
    assert _conv_triton.runs_on_triton(x, grouped, 128, False)
    assert _depthwise_triton.runs_depthwise_grad(x, depthwise, 256)
    with torchmb_config.use("triton", False):
        assert not _depthwise_triton.runs_depthwise_grad(x, depthwise, 256)
