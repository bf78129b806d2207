"""``import torchmb`` costs little more than ``import torch``: the compiler, GPU kernel libraries and the sweep's
plotting and Optuna load when first used, not on import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from batch_layers import constant_under_compile
from torchmb._module import BatchModule

ROOT = Path(__file__).resolve().parents[2]
# Each of these takes from a tenth of a second (Optuna) to as long as torch itself (dynamo with Inductor).
LAZY = ["torch._dynamo", "torch._inductor", "triton", "matplotlib", "optuna"]


def test_import_loads_no_compiler_kernel_library_or_sweep_tool(tmp_path: Path) -> None:
    # Triton is not installed with a CPU build of torch: a stand-in shows whether anything would import it.
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("")
    code = ("import importlib.util, json, sys, torchmb\n"
            "assert importlib.util.find_spec('triton').origin.startswith(sys.argv[1])\n"
            "print(json.dumps(sorted(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert run.returncode == 0, run.stderr
    loaded = set(json.loads(run.stdout))
    assert {"torchmb", "torchmb.optim", "batch_layers", "offload"} <= loaded
    assert not [name for name in LAZY if name in loaded]


def test_settled_order_is_marked_as_torch_compiler_marks_a_constant_result() -> None:
    def ours() -> None: ...

    def torchs() -> None: ...

    assert vars(constant_under_compile(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}
    assert vars(BatchModule._settled_order) == vars(ours)
