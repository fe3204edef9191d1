"""How much memory a model may still take: what the machine has left, and within it what this
process's control group allows (a container's limit, which the machine's figures do not show)."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def memory_available() -> tuple[int, int] | None:
    """(bytes a process can still allocate, the memory it may have in all) where the system says: Linux's
    MemAvailable (free memory and what the kernel can reclaim for it, the page cache among it) plus free
    swap, and MemTotal, each at most what the process's control group allows (`cgroup_memory`). None
    elsewhere (macOS compresses and swaps memory: no figure says what fails)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        available, total = fields["MemAvailable"] + fields.get("SwapFree", 0), fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    group = cgroup_memory()
    return (available, total) if group is None else (min(available, group[0]), min(total, group[1]))


def cgroup_memory(root: Path = CGROUP_ROOT, membership: str | None = None) -> tuple[int, int] | None:
    """(bytes this process's control group still lets it allocate, its limit) where a memory limit is set
    on the group or on one above it (the tightest), else None. The group's usage counts its page cache,
    which the kernel reclaims before it refuses memory: that is not taken off. cgroup v2: memory.max,
    memory.current and memory.stat's `file`; v1: memory.limit_in_bytes, memory.usage_in_bytes and
    memory.stat's `total_cache`. membership: /proc/self/cgroup's text (read where not given)."""
    try:
        membership = Path("/proc/self/cgroup").read_text() if membership is None else membership
    except OSError:
        return None
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":  # the unified hierarchy (v2)
            found = _tightest(root, parts[2], "memory.max", "memory.current", "file")
        elif "memory" in parts[1].split(","):
            found = _tightest(
                root / "memory", parts[2], "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache"
            )
        else:
            continue
        if found is not None:
            return found
    return None


def _tightest(base: Path, group: str, limit_file: str, usage_file: str, cache_field: str) -> tuple[int, int] | None:
    """The group's and its ancestors' (left, limit) with the least left. A group path that is not under
    `base` (a container's own view starts at its group) is read from `base` itself."""
    directory = base / group.lstrip("/")
    directory = directory if directory.is_dir() else base
    best = None
    while True:
        try:
            limit = (directory / limit_file).read_text().strip()
            if limit != "max" and int(limit) < NO_LIMIT:
                usage = int((directory / usage_file).read_text())
                stat = dict(
                    line.split() for line in (directory / "memory.stat").read_text().splitlines() if line.strip()
                )
                left = max(0, int(limit) - max(0, usage - int(stat.get(cache_field, 0))))
                best = min(best or (left, int(limit)), (left, int(limit)))
        except (OSError, ValueError):
            pass
        if directory == base or directory.parent == directory:
            return best
        directory = directory.parent
