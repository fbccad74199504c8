"""The CPUs this process may use and the default thread count: one thread per physical core it may run on.

A hyper-threaded sibling shares its core's load ports and caches; ternary matmuls are memory/port bound, so
a second thread on the same core adds little and makes every barrier wait for the slower sibling (the same
default llama.cpp and ollama pick). Physical cores come from Linux sysfs topology
(`cpuN/topology/core_cpus_list`, or the older `thread_siblings_list`), intersected with the affinity mask
(taskset, cgroups' cpusets); without sysfs the affinity count is the answer.
"""
from __future__ import annotations

import os

SYSFS_CPU = "/sys/devices/system/cpu"

# Rows one batched step computes (a token of each decoding sequence, then prompt tokens up to it): the default on
# the vector paths and on the AMX tiles (engine.batching.default_batch_tokens picks, with the measurements), and
# the most load_engine and `bitnet serve -b` take (the step's buffers are sized by it). Here, on the ground floor,
# so that the CLI checks -b without importing the engine.
BATCH_TOKENS_DEFAULT = 128
BATCH_TOKENS_TILES = 256
BATCH_TOKENS_MAX = 8192


def affinity_cpus() -> set[int]:
    """Logical CPU ids this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """Logical CPUs this process may run on (the cap for -t)."""
    return max(1, len(affinity_cpus()))


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}; raises ValueError on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi) if hi else int(lo)
        if b < a:
            raise ValueError(f"bad cpu range {part!r}")
        out.update(range(a, b + 1))
    return out


def _siblings(root: str, cpu: int) -> set[int] | None:
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(os.path.join(root, f"cpu{cpu}", "topology", name)) as f:
                s = parse_cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if cpu in s:
            return s
    return None


def physical_cores(root: str | None = None, cpus: set[int] | None = None) -> int:
    """Physical cores among `cpus` (default: the affinity mask), from the sysfs tree at `root`.

    A CPU whose topology cannot be read counts as its own core, so a missing sysfs gives the affinity count."""
    root = SYSFS_CPU if root is None else root
    cpus = affinity_cpus() if cpus is None else set(cpus)
    cores: set[frozenset[int]] = set()
    for c in cpus:
        sib = _siblings(root, c)
        cores.add(frozenset(sib & cpus) if sib else frozenset((c,)))
    return max(1, len(cores))


def default_threads(root: str | None = None) -> int:
    """The thread count used when -t is not given: OMP_NUM_THREADS when set to a positive integer
    (scripts and benchmarks pin it that way; capped at the logical CPUs available), else one per physical
    core available to this process."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return min(int(env), available_cores())
    return physical_cores(root)


def cpu_brand() -> str:
    """The CPU's marketing name ("AMD EPYC 7B13", "Apple M2", ...) from py-cpuinfo, which knows it on every OS
    and architecture (Linux on ARM has no "model name" line in /proc/cpuinfo). Slow: py-cpuinfo runs a child
    process that times the clock (1 to 3 s here), so only `bitnet info` and the benchmarks' headers call it,
    never the load path (that is why it is imported here and not at the top)."""
    try:
        import cpuinfo

        brand = cpuinfo.get_cpu_info().get("brand_raw")
    except Exception:   # py-cpuinfo parses many OS tools' output: whatever goes wrong, the platform's word
        brand = None
    if not brand:
        import platform

        brand = platform.processor() or platform.machine() or "unknown"
    return brand
