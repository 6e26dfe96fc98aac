"""Native memory discipline: the allocator, freed memory handed back, bounded oneDNN caches,
and the numbers to watch.

A long-running worker that allocates buffers of many sizes from several threads can keep RSS
far above what it uses: freed memory stays in glibc's arenas, scattered between live blocks
(fragmentation: soaks measured glibc's free-but-kept memory growing ~57 MB/h while the memory
in use fell). jemalloc, preloaded into the server (``use_allocator``), keeps it flat. These
helpers choose the allocator, limit glibc's arenas where glibc stays, hand freed memory back,
and report the allocator's own counts (in use / free but kept / mmapped) so that a rising RSS
can be told apart: live memory growing (a leak) or freed memory not returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

M_ARENA_MAX = -8
# oneDNN's primitive cache and ideep's cache each keep up to 1,024 entries keyed on tensor
# shapes; the decoders see a new length with almost every request, and each entry holds up to
# ~0.5 MB (measured with the bf16 decoder's linear layers): ~1 MB per new length, growing for
# hours towards a ceiling near 1 GB. The decoders' canvases take widths from a short list
# (``decoding.bucket``), each width ~9 primitives, and a mixed load's decode rounds (streams
# of 1-16 at once, whole answers) use ~190 of them after the warm-up: with 64 entries they
# were created again and again (2,659 creations in 35 s, 1.56 s of the scheduler's time,
# 2.8 ms a matrix product), with 256 once each (286), for 13 MB more RSS.
NATIVE_CACHE_ENTRIES = 256
NATIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KINDS = ("in_use", "free", "mmapped")  # what ``stats`` reports
# jemalloc's purging of freed pages runs on its own thread, so a service that falls quiet
# still hands memory back (without it, only the next allocations would); a forked worker
# starts its own (``purge_in_background``)
JEMALLOC_CONF = "background_thread:true"
MALLCTL_ARENAS_ALL = 4096  # jemalloc's "every arena" index in mallctl names


class AllocatorMissing(RuntimeError):
    """CHATTTS_ALLOCATOR=jemalloc, and no jemalloc library is installed."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)  # glibc 2.33+
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2
# jemalloc's control interface, where it was preloaded into this process
_MALLCTL: Any = getattr(ctypes.CDLL(None), "mallctl", None)


def allocator() -> str:
    """The allocator serving malloc in this process: ``jemalloc`` or ``system``."""
    return "jemalloc" if _MALLCTL is not None else "system"


def use_allocator(choice: str, environ=os.environ) -> None:
    """Run this process on jemalloc: re-execute it with the library preloaded (``auto``:
    where it is installed; ``jemalloc``: or raise ``AllocatorMissing``; ``system``: leave
    glibc). Call it first thing in ``main``, before threads or heavy imports; it does not
    return when it re-executes. ``MALLOC_CONF`` in the environment wins over ours."""
    if choice == "system" or allocator() == "jemalloc":
        return
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        if choice == "jemalloc":
            raise AllocatorMissing(
                "CHATTTS_ALLOCATOR=jemalloc, but no jemalloc library is installed "
                "(Debian: apt-get install libjemalloc2)"
            )
        log.warning("jemalloc is not installed: memory may creep up on glibc's allocator")
        return
    preloaded = environ.get("LD_PRELOAD", "")
    if library in preloaded.split(":"):  # preloaded, yet not serving malloc: do not loop
        log.warning("%s is in LD_PRELOAD but does not serve malloc", library)
        return
    child = dict(environ)
    child["LD_PRELOAD"] = ":".join(filter(None, (library, preloaded)))
    child.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], child)


def purge_in_background() -> bool:
    """Start jemalloc's purging thread in this process: a fork (gunicorn's worker) does not
    inherit its parent's. True where it runs; a no-op on glibc."""
    if _MALLCTL is None:
        return False
    enabled = ctypes.c_bool(True)
    size = ctypes.c_size_t(ctypes.sizeof(enabled))
    return _MALLCTL(b"background_thread", None, None, ctypes.byref(enabled), size) == 0


def _mallctl_size(name: str) -> int:
    value = ctypes.c_size_t(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if _MALLCTL(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        raise OSError(f"mallctl {name} failed")
    return value.value


def _jemalloc_stats() -> dict[str, int]:
    epoch = ctypes.c_uint64(1)  # writing the epoch refreshes jemalloc's cached statistics
    size = ctypes.c_size_t(ctypes.sizeof(epoch))
    _MALLCTL(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), size)
    allocated = _mallctl_size("stats.allocated")
    resident = _mallctl_size("stats.resident")
    return {"in_use": allocated, "free": max(0, resident - allocated), "mmapped": 0}


def limit_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own heap arena (up to 8 per core). The
    request threads allocate audio buffers, the model thread tensors: with one arena each, freed
    memory scatters over many arenas and RSS creeps up under steady load (a soak showed it).
    Two arenas, set before any thread starts, keep it compact. MALLOC_ARENA_MAX in the
    environment wins."""
    if os.environ.get("MALLOC_ARENA_MAX") or _LIBC is None:
        return
    try:
        _LIBC.mallopt(M_ARENA_MAX, arenas)
    except AttributeError:  # not glibc
        pass


def bound_native_caches(environ=os.environ, entries: int = NATIVE_CACHE_ENTRIES) -> None:
    """Cap the shape-keyed caches of torch's oneDNN backend (read once, when torch starts, so
    call this before torch is imported, or pass a child process's environment). Values already
    in the environment win."""
    for name in NATIVE_CACHE_VARIABLES:
        environ.setdefault(name, str(entries))


def release() -> None:
    """Hand freed heap memory back to the OS. glibc keeps large freed blocks in its arenas, so
    without this a burst of long requests leaves RSS high long after their caches are gone
    (hundreds of MB after loading the full model); jemalloc purges its arenas' dirty pages."""
    if _MALLCTL is not None:
        _MALLCTL(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0)
        return
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def stats() -> dict[str, int] | None:
    """Bytes in use (``in_use``: live allocations, on glibc the small and medium ones;
    ``mmapped``: on glibc the live large ones, 0 on jemalloc, whose ``in_use`` counts them)
    and held free by the allocator, not returned to the OS (``free``); None where neither
    glibc 2.33+ nor jemalloc can tell."""
    if _MALLCTL is not None:
        return _jemalloc_stats()
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd}
