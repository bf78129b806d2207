"""Inductor's numbers for convolutional BatchModules, each case checked against B plain models in a process of
its own.

A samples-major LeNet compiled with Inductor once trained on zero convolution gradients: a torch bug (Inductor's
CPU backend ran a fused kernel that read ``max_pool2d``'s gradient buffer before the scatter into it) that
torchmb routes around in ``torchmb._inductor_fixes``. It showed only where Inductor fused that way (on one CPU
thread), so each case runs on one thread in a fresh process with a fresh Inductor cache, where no earlier compile,
cache or thread setting of the session decides how Inductor fuses (``support/inductor_check.py``). The
plain-torch net that shows the bug without torchmb's layers checks the fix itself. Compiling takes most of a
minute on a CPU: one case runs by default, the others are slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_recompute_keeps_the_read_of_a_scattered_buffer_on_the_scatter() -> None:
    """What the fix does to one scheduler node, without compiling: after torch re-extracts the node's reads from
    its loop body (which names the scattered buffer by its real name, ``buf12``), the read is the scatter's
    (``buf13``) again, and applying the renames twice changes nothing."""
    from torch._inductor.dependencies import ReadWrites, StarDep
    from torch.utils._ordered_set import OrderedSet

    from torchmb._inductor_fixes import renames_reapplied

    def reads(*names: str) -> ReadWrites:
        return ReadWrites(OrderedSet(StarDep(name) for name in names), OrderedSet(), OrderedSet())

    class Node:  # what the fix uses of a SchedulerNode
        def __init__(self) -> None:
            self.mutation_renames = {"buf12": "buf13"}
            self.read_writes = reads("buf13", "le")

        def set_read_writes(self, read_writes: ReadWrites) -> None:
            self.read_writes = read_writes

    def recompute(node: Node) -> None:  # torch 2.13's recompute of a node without fake dependencies
        node.set_read_writes(reads("buf12", "le"))

    node = Node()
    recompute(node)
    assert [dep.name for dep in node.read_writes.reads] == ["buf12", "le"]  # the bug: the scatter's read lost
    renames_reapplied(recompute)(node)
    assert [dep.name for dep in node.read_writes.reads] == ["buf13", "le"]
    renames_reapplied(renames_reapplied(lambda node: None))(node)
    assert [dep.name for dep in node.read_writes.reads] == ["buf13", "le"]


@pytest.mark.parametrize(
    ("model", "order"),
    [
        pytest.param("lenet", "auto", id="lenet-samples-major"),
        pytest.param("lenet", "models", id="lenet-models-major", marks=pytest.mark.slow),
        pytest.param("batchnorm_cnn", "auto", id="batchnorm-cnn-samples-major", marks=pytest.mark.slow),
    ],
)
def test_inductor_trains_a_fresh_conv_model_like_plain_models(model: str, order: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # where Inductor's CPU fusion lost the scatter's order
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }
    run = subprocess.run([sys.executable, "-m", "support.inductor_check", model, order], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    assert run.stdout.strip().endswith("same as plain models"), run.stdout


def test_compile_caches_are_keyed_by_the_fix_after_the_users_tag() -> None:
    """A kernel compiled without the fix is not reused (the slow test below compiles one): every compile cache
    key carries the fix's tag, once, after whatever tag the user set."""
    import torch

    from torchmb import _inductor_fixes

    with torch.compiler.config.patch(cache_key_tag="my-job"):
        _inductor_fixes._tag_compile_caches()
        _inductor_fixes._tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"my-job|{_inductor_fixes.CACHE_KEY_TAG}"
    with torch.compiler.config.patch(cache_key_tag=""):
        _inductor_fixes._tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == _inductor_fixes.CACHE_KEY_TAG


def _scatter_net(cache: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }
    return subprocess.run([sys.executable, "-m", "support.inductor_scatter_net", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_fix_gives_plain_torch_the_eager_gradients_despite_a_cache_compiled_without_it(tmp_path: Path) -> None:
    """The torch bug on plain torch (``support/inductor_scatter_net.py``, pytorch/pytorch#185509): with
    ``torchmb._inductor_fixes`` applied, Inductor's gradients are eager's, whatever torchmb's layers compile to,
    and the kernels an earlier process compiled without the fix into the same Inductor cache are not reused."""
    _scatter_net(tmp_path, "--unfixed")  # wrong on a torch with the bug; it fills the cache either way
    run = _scatter_net(tmp_path)
    assert run.returncode == 0, run.stderr[-6000:]
    assert run.stdout.strip().endswith("same as eager"), run.stdout
