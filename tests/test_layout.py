"""The layout rules of the three packages (issue 18), checked on the whole source tree.

- no source file longer than :data:`MAX_FILE_LINES` lines, no class longer than :data:`MAX_CLASS_LINES`;
- no import cycle between modules (imports anywhere in a module, in functions too, and those under
  ``if TYPE_CHECKING:``: a circle of types is a circle of concerns);
- no private module of one package (``pkg._x``, or anything under it) imported from another package;
- imports point one way: ``torchmb -> batch_layers -> offload -> torchmb_config`` (see ``docs/contributing.md``);
- no environment variable read (``os.environ``, ``os.getenv``) outside ``torchmb_config``;
- no access to another object's private name (``obj._x`` where ``obj`` is not ``self``/``cls``) that the
  file does not define itself;
- no layer module of ``batch_layers`` branches on the merged layout: the order-dependent code lives in
  ``batch_layers.functional``, which the layer calls with ``layout=self.layout`` (issue 23).

The rules are checked with :mod:`ast` on every ``.py`` file of the packages, so files added later are
covered as they appear.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torchmb", "batch_layers", "offload", "torchmb_config")
ORDER = {"torchmb": 0, "batch_layers": 1, "offload": 2, "torchmb_config": 3}  # a package imports only those after it
MAX_FILE_LINES = 700
MAX_CLASS_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = (path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return out


SOURCES = _sources()


def _is_package(name: str) -> bool:
    return SOURCES.get(name, (Path(),))[0].name == "__init__.py"


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def _imports(name: str, *, type_checking: bool = False) -> list[tuple[str, int]]:
    """``(module, line)`` for each import in module ``name`` of a module of the packages: ``from a import b``
    names ``a.b`` when that is a module, else ``a``; with ``type_checking``, those under
    ``if TYPE_CHECKING:`` too."""
    _, tree = SOURCES[name]
    base = name if _is_package(name) else name.rpartition(".")[0]
    skip = set() if type_checking else _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append((sub if sub in SOURCES else mod, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


def test_files_are_short():
    long = {str(p.relative_to(ROOT)): n for p, _ in SOURCES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by concern): {long}"


def test_classes_are_short():
    long = {}
    for path, tree in SOURCES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long[f"{path.relative_to(ROOT)}::{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"classes over {MAX_CLASS_LINES} lines (compose them of parts): {long}"


def test_no_private_module_of_another_package_is_imported():
    bad = []
    for name in SOURCES:
        for mod, line in _imports(name):
            if mod.split(".")[0] != name.split(".")[0] and any(p.startswith("_") for p in mod.split(".")[1:]):
                bad.append(f"{SOURCES[name][0].relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "private modules imported across packages (make them public, documented modules):\n" + \
        "\n".join(bad)


def test_imports_point_one_way():
    bad = []
    for name in SOURCES:
        for mod, line in _imports(name):
            if ORDER[mod.split(".")[0]] < ORDER[name.split(".")[0]]:
                bad.append(f"{SOURCES[name][0].relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "imports against torchmb -> batch_layers -> offload:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (with ``type_checking``, also under
    ``if TYPE_CHECKING:``). An import of a package's ``__init__`` from inside that package (``from . import x``
    where ``x`` is no module) counts as an import of the ``__init__``."""
    graph = {}
    for name in SOURCES:
        graph[name] = {m for m, _ in _imports(name, type_checking=type_checking) if m in SOURCES and m != name}
    return graph


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles between modules: {cycles}"


def test_no_import_cycles_through_type_checking_imports():
    cycles = _cycles(import_graph(type_checking=True))
    assert not cycles, "import cycles between modules, TYPE_CHECKING " \
        f"imports included (give the callee a protocol or the parts it needs instead of its caller's type): {cycles}"


def test_type_checking_imports_are_seen():
    graph = import_graph(type_checking=True)
    assert "offload._staging" in graph["offload._engine"]
    assert "offload._staging" not in import_graph()["offload._engine"]


def _environment_reads(tree: ast.Module) -> list[int]:
    """Lines of ``os.environ`` / ``os.getenv`` / ``environ`` / ``getenv`` uses (``from os import ...`` too)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "getenvb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "environb", "getenvb") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_environment_is_read_only_by_the_config_module():
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, (path, tree) in SOURCES.items()
           if name.split(".")[0] != "torchmb_config" for line in _environment_reads(tree)]
    assert not bad, "environment variables read outside torchmb_config (add a switch there):\n" + "\n".join(bad)


def test_environment_read_finder():
    tree = ast.parse("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n")
    assert _environment_reads(tree) == [2, 3, 4]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_package_is_scanned(pkg):
    modules = 0 if pkg == "torchmb_config" else 1  # (the config package is one module)
    assert any(name == pkg for name in SOURCES) and sum(n.startswith(pkg + ".") for n in SOURCES) >= modules


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a file defines: functions, classes, module globals, ``self._x`` / ``cls._x`` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reaches() -> dict[tuple[str, str], int]:
    """``(file, name) -> count`` of ``obj._name`` accesses where ``obj`` is not ``self``, ``cls`` or
    ``super()``, and ``_name`` is defined by another file of the packages but not by this one (torch's own
    private names, ``module._parameters``, are not ours to police)."""
    defined = {name: _defined_private_names(tree) for name, (_, tree) in SOURCES.items()}
    ours = set().union(*defined.values())
    torch_names = set(dir(torch.nn.Module())) | set(dir(torch.Tensor)) | set(dir(torch.optim.SGD([torch.zeros(1)])))
    out: dict[tuple[str, str], int] = {}
    for name, (path, tree) in SOURCES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            obj = node.value
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
                continue
            root = obj
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "nn", "F"):
                continue
            if node.attr in defined[name] or node.attr not in ours or node.attr in torch_names:
                continue
            key = (str(path.relative_to(ROOT)), node.attr)
            out[key] = out.get(key, 0) + 1
    return out


def test_no_reach_into_another_files_private_names():
    found = sorted(_private_reaches())
    assert not found, "accesses to another object's private name (give it a public method, or pass what is " \
        f"needed): {found}"


def test_private_reach_finder():
    tree = ast.parse("class A:\n    def f(self, other):\n        self._mine = 1\n        return other._x + self._y\n")
    assert _defined_private_names(tree) == {"_mine"}


# -- layer modules do not branch on the layout (issue 23) ---------------------------------------------------------
ORDER_ATTRIBUTES = ("merged_order", "order")
ORDER_NAMES = ("models", "samples")


def _layout_branches(tree: ast.Module) -> list[int]:
    """Lines that read a layout's order (``.merged_order``, ``.order``) or compare with ``"models"`` /
    ``"samples"``; the class attribute declarations ``merged_order = ...`` / ``merged_orders = (...)`` are
    stores, not reads, and pass."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ORDER_ATTRIBUTES and isinstance(node.ctx, ast.Load):
            lines.add(node.lineno)
        elif isinstance(node, ast.Compare):
            for part in (node.left, *node.comparators):
                items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                if any(isinstance(item, ast.Constant) and item.value in ORDER_NAMES for item in items):
                    lines.add(node.lineno)
    return sorted(lines)


def _layer_module_files() -> list[str]:
    """``batch_layers/_*.py`` files that define a subclass of ``AbstractBatchModule``."""
    import importlib
    import inspect

    import batch_layers

    files = []
    for path in sorted((ROOT / "batch_layers").glob("_*.py")):
        name = f"batch_layers.{path.stem}"
        module = importlib.import_module(name)
        if any(inspect.isclass(obj) and obj.__module__ == name and issubclass(obj, batch_layers.AbstractBatchModule)
               and obj is not batch_layers.AbstractBatchModule for obj in vars(module).values()):
            files.append(str(path.relative_to(ROOT)))
    return files


def test_layer_modules_do_not_branch_on_the_layout():
    files = _layer_module_files()
    assert "batch_layers/_linear.py" in files and "batch_layers/_base.py" not in files
    bad = [f"{file}:{line}" for file in files for line in _layout_branches(SOURCES[_module_name(ROOT / file)][1])]
    assert not bad, "layer modules branching on the merged order (move that code into batch_layers.functional " \
        "and call it with layout=self.layout):\n" + "\n".join(bad)


def test_layout_branch_finder():
    source = (
        "class A:\n"
        "    merged_order = 'models'\n"
        "    merged_orders = ('models', 'samples')\n"
        "    def forward(self, x):\n"
        "        if self.merged_order == 'models':\n"
        "            return x\n"
        "        if current_forward().order in ('samples',):\n"
        "            return x\n"
        "        return f(x, layout=self.layout)\n"
        "def g(order):\n"
        "    return 1 if order == 'samples' else 2\n"
    )
    assert _layout_branches(ast.parse(source)) == [5, 7, 11]
