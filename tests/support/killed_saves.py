"""Kill a save at random moments and check what it leaves: the old version or the new one, whole.

:func:`kill_during_saves` forks the test process (fast: torch is already imported) into a child that saves
the other version to the same path, sends it SIGKILL after a seeded random delay drawn over the length of
one save, and then reads the path back: it must hold exactly one of the two versions. The child is a real
process killed as ``kill -9`` kills one, with no chance to clean up.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def _wait_until_gone(group: int) -> None:
    """Until every process of the killed group has been reaped (its other ranks, by init)."""
    for _ in range(500):
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def kill_during_saves(path: Path, save: Callable[[int], None], load: Callable[[], Any], versions: list[Any], *,
                      seed: int, kills: int = 6) -> int:
    """Save ``versions[0]`` with ``save(0)``; then, ``kills`` times, kill a child process saving the other
    version mid-save and check that ``load()`` equals ``versions[0]`` or ``versions[1]`` (``==``).

    ``path`` must be the only entry of its parent directory. Returns how many kills left something beside
    ``path`` (a save cut off mid-way); the caller asserts that some did.
    """
    rng = random.Random(seed)
    start = time.perf_counter()
    save(0)
    duration = time.perf_counter() - start
    current, cut_off = 0, 0
    for _ in range(kills):
        target = 1 - current
        pid = os.fork()
        if pid == 0:  # the child: save, and leave without running the parent's exit handlers
            try:
                os.setpgid(0, 0)  # a group of its own: the processes it starts (other ranks) die with it
                save(target)
            finally:
                os._exit(0)
        # the parent sets the group too, so that it exists when the kill comes however early the child is
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpgid(pid, pid)
        time.sleep(rng.uniform(0.0, 1.2 * duration))
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _wait_until_gone(pid)
        cut_off += bool(_leftovers(path))
        got = load()
        matches = [v for v in (current, target) if got == versions[v]]
        assert matches, f"after a kill {path} holds neither version {current} nor version {target}"
        current = matches[-1]
    assert _leftovers(path) == [], f"the load left {_leftovers(path)} beside {path}"
    return cut_off
