"""Every public name of torchmb, batch_layers and offload is on a reference page, and every public function,
class and method has a docstring.

Public names are the ``__all__`` of the three packages and of their public submodules (those whose dotted name
has no component starting with ``_``); a name is on a reference page when an autodoc directive of
``docs/reference`` documents it, by its own name or under another public path (``torchmb.AbstractBatchModule`` is
``batch_layers.AbstractBatchModule``), or names it in an ``automodule``'s or ``autoclass``'s ``:members:``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path
from typing import Any

from support.torchvision_ops import import_torchvision

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torchmb", "batch_layers", "offload")
# An autodoc directive, its target, and the indented option lines below it (``:members:`` may wrap).
import_torchvision()  # the integrations import Lightning and transformers, which import torchvision
DIRECTIVE = re.compile(r"^\.\. auto\w+::[ \t]*(\S+)[ \t]*\n((?:[ \t]+\S[^\n]*\n?)*)", re.MULTILINE)
MEMBERS = re.compile(r":members:(.*?)(?=\s:[\w-]+:|$)")


def resolve(dotted: str) -> Any:
    """The object a directive names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def documented_objects() -> dict[int, str]:
    """``id`` of every object the reference pages document, with the directive that does."""
    found = {}
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for target, options in DIRECTIVE.findall(page.read_text()):
            obj = resolve(target)
            found[id(obj)] = f"{page.name}: {target}"
            listed = MEMBERS.search(" ".join(options.split()))
            if listed is None:
                continue
            names = [n.strip() for n in listed.group(1).split(",") if n.strip()]
            for name in names or getattr(obj, "__all__", []):
                found[id(getattr(obj, name))] = f"{page.name}: {target} :members: {name}"
    return found


def public_modules() -> list[types.ModuleType]:
    modules = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                modules.append(importlib.import_module(info.name))
    return modules


def public_names() -> dict[str, Any]:
    """Every public dotted name (not a module) and its object."""
    return {f"{module.__name__}.{name}": getattr(module, name)
            for module in public_modules() for name in getattr(module, "__all__", [])
            if not isinstance(getattr(module, name), types.ModuleType)}


def ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in PACKAGES


def test_every_public_name_is_on_a_reference_page() -> None:
    documented = documented_objects()
    missing = sorted(name for name, obj in public_names().items() if id(obj) not in documented)
    assert not missing, f"public names on no page of docs/reference (add an autodoc directive): {missing}"


def test_every_public_function_class_and_method_has_a_docstring() -> None:
    undocumented = []
    for name, obj in public_names().items():
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and ours(obj) and not inspect.getdoc(obj):
            undocumented.append(name)
        if not inspect.isclass(obj) or not ours(obj):
            continue
        for attr, raw in vars(obj).items():
            if attr.startswith("_"):
                continue
            member = getattr(obj, attr)
            if isinstance(raw, property) or inspect.isfunction(member) or inspect.ismethod(member):
                if not inspect.getdoc(raw if isinstance(raw, property) else member):
                    undocumented.append(f"{name}.{attr}")
    assert not undocumented, f"public callables without a docstring: {sorted(undocumented)}"


def test_the_checks_see_a_missing_page_entry_and_a_missing_docstring() -> None:
    documented = documented_objects()
    names = public_names()
    assert id(names["torchmb.graphs.CapturedStep"]) in documented
    assert id(names["offload.cuda_launch.VECTOR_TYPES"]) in documented  # listed on a wrapped :members: line

    class Undocumented:
        def method(self) -> None:
            pass

    assert id(Undocumented) not in documented and not inspect.getdoc(Undocumented.method)
