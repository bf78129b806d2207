"""What a user installs is the wheel, not the checkout: build the sdist and, from it, the wheel; pip installs
the wheel with the integrations' extras into a fresh environment, which imports every module, runs the
README's quickstart and trains with each integration, from outside the checkout."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchmb", "batch_layers", "offload", "torchmb_config")
# The extras of the integrations; the rest of the packages imports without any extra.
EXTRAS = ("lightning", "transformers")
QUICKSTART = re.compile(r"^## Quickstart\n.*?^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# What the build needs of the checkout; the rest (a virtualenv, build output, caches) stays behind.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "_build",
                                    "demo-output", ".*_cache", ".hypothesis")


def subpackages() -> list[str]:
    """Every package of the checkout, as a dotted name: each directory of the four holding ``__init__.py``."""
    return sorted(".".join(init.parent.relative_to(ROOT).parts)
                  for name in PACKAGES for init in (ROOT / name).rglob("__init__.py"))


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel built from it, without network access (``--no-isolation``: this environment's
    setuptools), from a copy of the checkout, so the build leaves nothing in the tree."""
    tree = tmp_path_factory.mktemp("tree") / "torchmb"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
                   check=True, capture_output=True, timeout=120)
    return out


def test_sdist_holds_every_package_license_and_markers(dist: Path) -> None:
    (sdist,) = dist.glob("torchmb-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = [p for p in subpackages() if p.replace(".", "/") + "/__init__.py" not in names]
    assert not missing, f"the sdist lacks {missing}"
    assert {"LICENSE", "pyproject.toml", "README.md", *(f"{name}/py.typed" for name in PACKAGES)} <= names


def test_wheel_holds_every_marker_and_the_license(dist: Path) -> None:
    (wheel,) = dist.glob("torchmb-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"{name}/py.typed" for name in PACKAGES} <= names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)


def local_package_indexes() -> list[str]:
    """pip's options that keep it to the package indexes on this machine's disk which its configuration names
    (CI reaches no other), in place of its default index; none where it names none."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                            text=True, timeout=60).stdout
    urls = [url for line in config.splitlines() if line.split("=", 1)[0].endswith("index-url")
            for url in line.split("=", 1)[1].strip("'\"").split()]
    local = [url for url in urls if url.startswith("file:")]
    return ["--index-url", local[0], *(f"--extra-index-url={url}" for url in local[1:])] if local else []


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh environment holding what a user installs: this environment's torch (installed
    first, as torch's own instructions say), then the wheel with the integrations' extras, whose dependencies
    pip resolves. None of them needs torchvision, so none is there to mismatch the torch."""
    (wheel,) = dist.glob("torchmb-*.whl")
    env = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = env / "bin" / "python"
    # --no-compile: pip would byte-compile every installed file (a third of the CPU time of these tests); the
    # checks compile only what they import
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
         *local_package_indexes(), f"torch=={importlib.metadata.version('torch')}", f"{wheel}[{','.join(EXTRAS)}]"],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    return python


def run_installed(python: Path, code: str, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    """``code`` run by the fresh environment's python from outside the checkout (with ``path`` on its
    ``PYTHONPATH``)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), **({"PYTHONPATH": str(path)} if path else {})}
    return subprocess.run([str(python), "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def printed_by_installed(python: Path, code: str, cwd: Path) -> str:
    """What ``code`` printed, run by the fresh environment's python from outside the checkout."""
    run = run_installed(python, code, cwd)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_installed_wheel_imports_every_module_and_runs_the_quickstart(installed: Path, tmp_path: Path) -> None:
    quickstart = QUICKSTART.search((ROOT / "README.md").read_text())
    assert quickstart, "README.md has no python block under '## Quickstart'"
    check = textwrap.dedent(f"""
        import importlib, importlib.metadata, pkgutil, sysconfig
        from pathlib import Path
        site = Path(sysconfig.get_paths()["purelib"])
        for name in {PACKAGES!r}:
            package = importlib.import_module(name)
            assert Path(package.__file__).parent == site / name, package.__file__
            assert (site / name / "py.typed").is_file(), name
            for module in pkgutil.walk_packages(package.__path__, name + "."):
                loaded = importlib.import_module(module.name)
                assert Path(loaded.__file__).is_relative_to(site), loaded.__file__
                print(module.name)
        files = importlib.metadata.distribution("torchmb").files
        assert any(f.name == "LICENSE" and f.locate().is_file() for f in files), files
    """)
    imported = set(printed_by_installed(installed, check + quickstart.group(1), tmp_path).split())
    modules = {".".join(path.with_suffix("").relative_to(ROOT).parts).removesuffix(".__init__")
               for name in PACKAGES for path in (ROOT / name).rglob("*.py")}
    assert {"torchmb.integrations.lightning", "torchmb.integrations.transformers"} <= modules
    assert not modules - set(PACKAGES) - imported, "a module of the checkout was not imported from the wheel"


@pytest.mark.slow  # about 20 s more on CI's machine: Lightning's and transformers' imports and their trainers
def test_installed_integrations_train_each_model_as_plain_torch_would(installed: Path, tmp_path: Path) -> None:
    printed_by_installed(installed, LIGHTNING_STEPS + TRANSFORMERS_STEPS, tmp_path)


def test_the_integrations_import_beside_a_torchvision_built_for_another_torch(installed: Path, tmp_path: Path) -> None:
    """PyPI's torchvision, built for the CUDA torch, beside the CPU torch: its compiled operators cannot load and
    ``import torchvision`` fails, yet Lightning and transformers import it; the integrations still import."""
    beside = tmp_path / "beside"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", "--target", str(beside),
         *local_package_indexes(), f"torchvision=={importlib.metadata.version('torchvision')}", "pillow"],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    alone = run_installed(installed, "import torchvision", tmp_path, beside)
    if alone.returncode:  # this machine's torch is a build the wheel does not match (CI's CPU torch)
        assert "operator torchvision::nms does not exist" in alone.stderr, alone.stderr
    imported = run_installed(installed, "import torchmb.integrations.lightning, torchmb.integrations.transformers; "
                             "import torchvision; print(torchvision.__file__)", tmp_path, beside)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(beside)), imported.stdout


# Two steps of Lightning's Trainer on three linear models, each against the same model trained alone by plain torch.
LIGHTNING_STEPS = """
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import torchmb
from torchmb.integrations.lightning import BatchLightningModule

LRS = [0.3, 0.1, 0.03]
generator = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(8, 5, generator=generator, dtype=torch.float64),
                                torch.randint(0, 3, (8,), generator=generator)), batch_size=4)


class Sweep(BatchLightningModule):
    def __init__(self):
        super().__init__()
        self.models = torchmb.BatchModule(torch.nn.Linear(5, 3).double(), len(LRS), init="independent", seed=0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = torchmb.batch_loss(self.models(x, shared_input=True), y)
        self.log("loss", losses)
        return losses.sum()

    def configure_optimizers(self):
        return torchmb.optim.SGD(self.models.parameters(), lr=LRS)


module = Sweep()
plain = [torch.nn.Linear(5, 3).double() for _ in LRS]
for model, state in zip(plain, module.models.state_dicts()):
    model.load_state_dict(state)
pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False).fit(module, data)
for i, (model, lr) in enumerate(zip(plain, LRS)):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for key, value in module.models.state_dict_of(i).items():
        torch.testing.assert_close(value, model.state_dict()[key], msg=f"Lightning, model {i}: {key}")
"""

# Two steps of the BatchTrainer on two tiny GPT-2s, each against the same model trained alone by plain torch.
TRANSFORMERS_STEPS = """
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from torchmb.integrations.transformers import BatchTrainer

CONFIG = GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=6, vocab_size=11, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TOKENS = torch.randint(1, 11, (4, 6), generator=generator)
RATES = torch.tensor([1e-2, 1e-3], dtype=torch.float64)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(TOKENS)

    def __getitem__(self, i):
        return {"input_ids": TOKENS[i], "labels": TOKENS[i], "position_ids": torch.arange(6)}


models = torchmb.BatchModule.from_factory(lambda: GPT2LMHeadModel(CONFIG).double(), len(RATES), seed=0)
plain = [GPT2LMHeadModel(CONFIG).double() for _ in RATES]
for model, state in zip(plain, models.state_dicts()):
    model.load_state_dict(state)
args = TrainingArguments(output_dir="trainer", per_device_train_batch_size=2, max_steps=2, save_strategy="no",
                         report_to=[], use_cpu=True, lr_scheduler_type="constant", weight_decay=0.0,
                         disable_tqdm=True, train_sampling_strategy="sequential")
BatchTrainer(models, args, learning_rates=RATES, train_dataset=Tokens()).train()
for i, (model, lr) in enumerate(zip(plain, RATES)):
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(lr), betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=0.0)
    for rows in (slice(0, 2), slice(2, 4)):
        model(input_ids=TOKENS[rows], labels=TOKENS[rows]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    for key, value in models.state_dict_of(i).items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=1e-5, atol=1e-7,
                                   msg=f"transformers, model {i}: {key}")
"""
