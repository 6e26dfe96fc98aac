"""Native memory discipline: fewer glibc arenas, freed memory handed back, bounded oneDNN
caches, and the numbers to watch.

A long-running worker that allocates buffers of many sizes from several threads can keep RSS
far above what it uses: freed memory stays in glibc's arenas. These helpers limit the arenas,
trim them, and report ``mallinfo2`` (in use / free in the arenas / mmapped) so that a rising
RSS can be told apart: live memory growing (a leak) or freed memory not returned
(fragmentation). Everything is a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8
# oneDNN's primitive cache and ideep's cache each keep up to 1,024 entries keyed on tensor
# shapes; the decoders see a new length with almost every request, and each entry holds up to
# ~0.5 MB (measured with the bf16 decoder's linear layers): ~1 MB per new length, growing for
# hours towards a ceiling near 1 GB. 64 entries hold every shape one decode step or one audio
# decode uses (measured: no slower), and bound the two caches to a few tens of MB.
NATIVE_CACHE_ENTRIES = 64
NATIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KINDS = ("in_use", "free", "mmapped")  # what ``stats`` reports


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
    (hundreds of MB after loading the full model)."""
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def stats() -> dict[str, int] | None:
    """Bytes in use (``in_use``: live small and medium allocations; ``mmapped``: live large
    ones) and held free inside the arenas (``free``), over all arenas; None without glibc
    2.33+."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd}
