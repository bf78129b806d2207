"""``repr(BatchModule)``: torch's module tree, each converted module's line naming the path that runs it.

The text is torch's own (``nn.Module.__repr__``, and ``nn.ModuleList``'s runs of equal entries such as
``(0-11): 12 x Block(...)``), with ``[path]`` before the class name of every module the conversion batched
(``registered``: its batched class; ``generic-own`` / ``generic-whole``: its own state, or its whole
subtree, per model through ``torch.func``; ``broadcast-own``: its own element-wise parameters broadcast per
model on the merged axis; ``shared``: the plain module over all B*n samples). Modules that
run unchanged on the merged axis (``passthrough``) carry no tag. A module whose class writes its own
``__repr__`` is shown by it, untagged inside.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["tagged_repr"]

_TORCH_REPRS = (nn.Module.__repr__, nn.ModuleList.__repr__)


def tagged_repr(module: nn.Module, tags: Mapping[int, str]) -> str:
    """torch's repr of ``module`` (as ``nn.Module.__repr__`` writes it, whatever its class's own), each module
    below it whose ``id`` is in ``tags`` shown as ``[tag] Class(...)``."""
    name = module._get_name()
    if id(module) in tags:
        name = f"[{tags[id(module)]}] {name}"
    children = [(key, _child_repr(child, tags)) for key, child in module._modules.items()]
    if isinstance(module, nn.ModuleList):  # its runs of equal entries, and no extra_repr
        if not children:
            return f"{name}()"
        return f"{name}(\n  " + "\n  ".join(f"({key}): {_indent(text)}" for key, text in _runs(children)) + "\n)"
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    lines = extra_lines + [f"({key}): {_indent(text)}" for key, text in children]
    if not lines:
        return f"{name}()"
    if len(extra_lines) == 1 and not children:
        return f"{name}({extra_lines[0]})"
    return f"{name}(\n  " + "\n  ".join(lines) + "\n)"


def _child_repr(module: nn.Module | None, tags: Mapping[int, str]) -> str:
    if module is None or type(module).__repr__ not in _TORCH_REPRS:
        return repr(module)
    return tagged_repr(module, tags)


def _runs(children: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A run of equal entries as one, ``("0-2", "3 x Linear(...)")``, as ``nn.ModuleList`` shows it."""
    runs: list[list] = []  # [first key, last key, text, length]
    for key, text in children:
        if runs and runs[-1][2] == text:
            runs[-1][1] = key
            runs[-1][3] += 1
        else:
            runs.append([key, key, text, 1])
    return [(first, text) if n == 1 else (f"{first}-{last}", f"{n} x {text}") for first, last, text, n in runs]


def _indent(text: str) -> str:
    """torch's ``_addindent(text, 2)``: every line but the first indented by two spaces."""
    lines = text.split("\n")
    return "\n".join([lines[0], *("  " + line for line in lines[1:])])
