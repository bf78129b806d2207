"""Host synchronisations made by the offload package, counted with torch's sync debug mode."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def offload_syncs(fn: Callable[[], object]) -> list[str]:
    """Run ``fn`` and return ``file:line`` of each host synchronisation that code in the ``offload``
    package made meanwhile (torch's own, such as the one it reports when the debug mode is switched on,
    are left out)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in got
            if "synchroniz" in str(w.message) and w.filename.replace("\\", "/").split("/")[-2] == "offload"]
