"""What the CPU offers, read once from /proc/cpuinfo (Linux; None elsewhere)."""

from __future__ import annotations


def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (vendor_id, flags, ...); None where unknown."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
