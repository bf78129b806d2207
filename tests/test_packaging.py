"""What a user installs is the wheel, not the checkout: build the sdist and, from it, the wheel; install the
wheel into a fresh environment and run the README's quickstart there, from outside the checkout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchmb", "batch_layers", "offload", "torchmb_config")
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


def test_wheel_installs_and_runs_the_quickstart_outside_the_checkout(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("torchmb-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"{name}/py.typed" for name in PACKAGES} <= names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)

    # A fresh environment that sees this one's packages (torch) through a plain path entry, so that this
    # environment's .pth files, an editable install of torchmb among them, are not run there.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=120)

    quickstart = QUICKSTART.search((ROOT / "README.md").read_text())
    assert quickstart, "README.md has no python block under '## Quickstart'"
    # The integrations import Lightning and transformers, which import torchvision: beside this machine's CPU
    # torch, PyPI's torchvision needs tests/support's declarations of its operators (torchvision_ops.py).
    check = textwrap.dedent(f"""
        import importlib, importlib.metadata, pkgutil, sys
        from pathlib import Path
        sys.path.append({str(ROOT / "tests")!r})
        from support.torchvision_ops import import_torchvision
        import_torchvision()
        site = Path({str(site)!r})
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
    run = subprocess.run([str(python), "-c", check + quickstart.group(1)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    imported = set(run.stdout.split())
    assert set(subpackages()) - set(PACKAGES) <= imported, "a subpackage of the checkout was not imported"
