"""Every ```python block of the tutorials, reference pages and README runs, in order, one namespace per page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.torchvision_ops import import_torchvision

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
REFERENCE_WITH_CODE = [p for p in sorted((ROOT / "docs" / "reference").glob("*.md")) if BLOCK.search(p.read_text())]
PAGES = [*sorted((ROOT / "docs" / "tutorials").glob("*.md")), *REFERENCE_WITH_CODE, ROOT / "README.md"]
# Pages that run torch.compile, where torch warns about its own code: Inductor's start-up imports
# torch.utils.mkldnn, which uses torch.jit.script_method; dynamo instantiates the custom autograd Functions
# it traces and reads .grad of the non-leaf tensors it resumes with after the graph break at backward()
COMPILING = {"optim.md"}  # their file names
TORCH_COMPILE_WARNINGS = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]


PARAMS = [
    pytest.param(page, id=page.relative_to(ROOT).as_posix(), marks=TORCH_COMPILE_WARNINGS * (page.name in COMPILING))
    for page in PAGES
]


@pytest.mark.parametrize("page", PARAMS)
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page.name} has no python block to run"
    if any(f"import {name}" in block for block in blocks for name in ("timm", "torchvision", "transformers")):
        import_torchvision()  # this machine's torch may be the CPU build (see tests/support/torchvision_ops.py)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"{page.name} block {number}", "exec")
        exec(code, namespace)
