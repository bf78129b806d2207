"""What offload reports of the host's memory, against what the kernel itself says."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

import offload


def test_host_memory_available_is_the_kernels_memavailable_and_memlock_limit() -> None:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kernel = int(fields["MemAvailable"].split()[0]) * 1024
    info = offload.host_memory_available()
    assert info["available"] == pytest.approx(kernel, rel=0.05)  # other processes allocate between the reads
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert info["memlock"] == (None if soft == resource.RLIM_INFINITY else soft)
