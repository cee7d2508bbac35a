"""The machine's memory figures, as Linux's /proc/meminfo gives them."""

from __future__ import annotations

from pathlib import Path


def meminfo(field: str) -> int | None:
    """A /proc/meminfo figure in bytes (MemTotal; MemAvailable: free memory and the page cache the kernel can
    reclaim), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
