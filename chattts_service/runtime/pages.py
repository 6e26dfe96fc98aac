"""A file read over and over (the packed GPT) held in the page cache in 2 MB pages.

A decode step reads every packed weight once, 190 MB in 4 KB pages: a TLB miss every 4 KB,
which a virtual machine pays twice (its own page tables and the host's). Where the page cache
holds the file in 2 MB folios, and the mapping is 2 MB aligned, the kernel maps it 2 MB at a
time (``FilePmdMapped`` in ``/proc/<pid>/smaps``): the int8 product read its weights ~10%
faster here (AMD EPYC, Zen 3). The folios' size is set when the file is read into the page
cache: a read-only mapping advised ``MADV_HUGEPAGE`` and faulted in whole gets 2 MB ones, where
pages written by a process, or faulted through a private writable mapping (as torch maps a
file), stay 4 KB. So before the file is mapped for use, ``settle`` reads it in that way, and
where the cache already holds it in small pages and nobody maps them, drops them first.
Best effort throughout: without transparent huge pages, or on a file system without large
folios, the file is simply read as before.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_POPULATE_READ = 22  # Linux 5.14: fault the whole range in, read-only
SETTLED = 0.9  # this much of the file in 2 MB mappings is as good as it gets (its tail)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_allowed() -> bool:
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def mappings_of(path: Path, smaps: Path = Path("/proc/self/smaps")) -> list[tuple[list, dict]]:
    """This process's mappings of ``path``: each one's header fields (address range,
    permissions, ...) and its counters in kB (``FilePmdMapped``, ``Anonymous``, ...); none where
    smaps cannot be read."""
    target, found = str(Path(path).resolve()), []
    counters: dict[str, int] | None = None
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            counters = None
            if len(fields) >= 6 and " ".join(fields[5:]) == target:
                counters = {}
                found.append((fields, counters))
        elif counters is not None and len(fields) >= 2 and fields[0].endswith(":"):
            try:
                counters[fields[0][:-1]] = int(fields[1])
            except ValueError:
                pass
    return found


def mapped_in_huge_pages(path: Path, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of ``path`` this process maps 2 MB at a time, over all its mappings of it."""
    return sum(counters.get("FilePmdMapped", 0) for _, counters in mappings_of(path, smaps)) * 1024


def _read_in(descriptor: int, size: int) -> float:
    """Map the file read-only, advised for huge pages, fault it in whole; the fraction of it
    mapped 2 MB at a time."""
    with mmap.mmap(descriptor, size, prot=mmap.PROT_READ) as mapping:
        mapping.madvise(mmap.MADV_HUGEPAGE)
        try:
            mapping.madvise(MADV_POPULATE_READ)
        except OSError:  # an older kernel: one byte a page
            for offset in range(0, size, mmap.PAGESIZE):
                mapping[offset]
        return mapped_in_huge_pages_of(descriptor) / size


def mapped_in_huge_pages_of(descriptor: int) -> int:
    return mapped_in_huge_pages(Path(os.readlink(f"/proc/self/fd/{descriptor}")))


def settle(path: Path) -> float:
    """Have the page cache hold ``path`` in 2 MB folios, as far as the system allows; returns
    the fraction of the file a mapping of it then maps 2 MB at a time (0 where it cannot)."""
    if not huge_pages_allowed():
        return 0.0
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return 0.0
    try:
        size = os.fstat(descriptor).st_size
        if size < HUGE_PAGE:
            return 0.0
        fraction = _read_in(descriptor, size)
        if fraction < SETTLED:
            # cached in small pages (just written, or read through a private mapping): drop
            # the pages nobody maps (written back first, or they could not go) and read again
            os.fdatasync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            fraction = _read_in(descriptor, size)
        return fraction
    except (OSError, ValueError) as error:
        log.debug("could not settle %s in huge pages: %s", path, error)
        return 0.0
    finally:
        os.close(descriptor)


MADV_DONTNEED = 4


def drop_mapped(path: Path, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Drop this process's resident pages of its private mappings of ``path`` that it never
    wrote to (no page copied on write: each page is the file's); returns the bytes dropped. Such a
    page touched again is read back from the file, so nothing is lost but memory the process
    no longer reads: weights it has converted and copied elsewhere, kept mapped while a small
    tensor of the same file lives on. Best effort."""
    import ctypes

    ranges = []
    for header, counters in mappings_of(path, smaps):
        if header[1].endswith("p"):  # private; one copied on write has anonymous pages
            start, end = (int(value, 16) for value in header[0].split("-"))
            ranges.append((start, end - start, counters.get("Anonymous", 0)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, length, written in ranges:
        if written:  # a page the process changed: dropping it would lose the change
            continue
        if libc.madvise(start, length, MADV_DONTNEED) == 0:
            dropped += length
        else:
            log.debug("madvise(DONTNEED) on %s failed: errno %d", path, ctypes.get_errno())
    return dropped
