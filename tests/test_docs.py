"""Every ```python block of the tutorials, reference pages and README runs, in order, one namespace per page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.torchvision_ops import import_torchvision

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
REFERENCE_WITH_CODE = [p for p in sorted((ROOT / "docs" / "reference").glob("*.md")) if BLOCK.search(p.read_text())]
# Pages whose code takes another path where a GPU is (CapturedStep, the memory search on the device)
GPU_PAGES = [ROOT / "docs" / "tutorials" / "speed.md"]
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
# Pages that call peft, whose 0.21 calls transformers 5's deprecated is_gradient_checkpointing when it wraps a model
PEFT = {"finetuning.md"}
PEFT_WARNINGS = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]


# Lightning's own warnings: a hint about data-loader workers, its use of a pytree name torch deprecated, and
# the directory a resumed run saves into again
LIGHTNING_WARNINGS = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),  # resuming
]
# GPT-2's Conv1D has no registered batched layer yet: torchmb warns that it runs on the generic path
GENERIC_PATH_WARNING = [pytest.mark.filterwarnings("ignore:torchmb. .* batched through torch.func:UserWarning")]
# Imports that import torchvision: timm, torchvision, Lightning (through torchmetrics), transformers' Trainer
IMPORTING_TORCHVISION = ("import timm", "import torchvision", "lightning", "from transformers", "import transformers")


PARAMS = [
    pytest.param(
        page,
        id=page.relative_to(ROOT).as_posix(),
        marks=TORCH_COMPILE_WARNINGS * (page.name in COMPILING)
        + PEFT_WARNINGS * (page.name in PEFT)
        + LIGHTNING_WARNINGS * (page.name == "lightning.md")
        + GENERIC_PATH_WARNING * (page.name == "transformers_trainer.md"),
    )
    for page in PAGES
]


@pytest.mark.parametrize("page", PARAMS)
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page.name} has no python block to run"
    if any(name in block for block in blocks for name in IMPORTING_TORCHVISION):
        import_torchvision()  # this machine's torch may be the CPU build (see tests/support/torchvision_ops.py)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"{page.name} block {number}", "exec")
        exec(code, namespace)


@pytest.mark.cuda
@pytest.mark.parametrize("page", GPU_PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_page_code_runs_on_a_gpu(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages whose code branches on the device, run where their CUDA branch is taken (``pytest -m cuda``)."""
    test_page_code_runs(page, tmp_path, monkeypatch)
