"""The packed GPT read into the page cache in 2 MB pages (``runtime/pages.py``)."""

import mmap
import os

import pytest

from chattts_service.runtime import pages


def _smaps_entry(path, pmd_kb: int, start: int) -> str:
    return (
        f"{start:x}-{start + 0x400000:x} r--s 00000000 fe:00 42    {path}\n"
        f"Size:               4096 kB\nFilePmdMapped:    {pmd_kb} kB\nLocked:  0 kB\n"
    )


def test_huge_mappings_are_summed_over_the_files_own_mappings_only(tmp_path):
    weights, other = tmp_path / "gpt.pt", tmp_path / "other.pt"
    weights.write_bytes(b"x")
    other.write_bytes(b"x")
    smaps = tmp_path / "smaps"
    smaps.write_text(
        _smaps_entry(weights, 2048, 0x7F0000000000)
        + _smaps_entry(other, 4096, 0x7F0000400000)
        + _smaps_entry(weights, 4096, 0x7F0000800000)
        + "7f0000c00000-7f0000e00000 rw-p 00000000 00:00 0\nFilePmdMapped:    2048 kB\n"
    )
    assert pages.mapped_in_huge_pages(weights, smaps) == 6 * 2**20
    assert pages.mapped_in_huge_pages(tmp_path / "absent.pt", smaps) == 0


def test_settling_a_just_written_file_keeps_its_bytes_and_reports_what_maps_huge(tmp_path):
    path = tmp_path / "gpt.pt"
    content = os.urandom(3 * pages.HUGE_PAGE + 12345)
    path.write_bytes(content)  # written by this process: in the page cache in small pages
    fraction = pages.settle(path)
    assert 0.0 <= fraction <= 1.0
    assert path.read_bytes() == content
    # what it reports is what a mapping of the file then gets, again and at once
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as view:
        view.madvise(mmap.MADV_HUGEPAGE)
        view.madvise(pages.MADV_POPULATE_READ)
        assert pages.mapped_in_huge_pages(path) / len(content) == pytest.approx(fraction)
    if pages.huge_pages_allowed() and fraction > 0:
        assert fraction >= pages.SETTLED  # whole 2 MB pages, all but the file's tail
    assert pages.settle(path) == pytest.approx(fraction)


def test_nothing_is_settled_where_huge_pages_are_off_or_the_file_is_small(tmp_path, monkeypatch):
    path = tmp_path / "gpt.pt"
    path.write_bytes(os.urandom(3 * pages.HUGE_PAGE))
    small = tmp_path / "small.pt"
    small.write_bytes(b"y" * 4096)
    assert pages.settle(small) == 0.0
    assert pages.settle(tmp_path / "absent.pt") == 0.0
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(pages, "THP_SETTING", setting)
    assert not pages.huge_pages_allowed()
    assert pages.settle(path) == 0.0


def _resident_kb(path) -> int:
    target, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and " ".join(fields[5:]) == target
            elif inside and fields and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_dropping_a_files_clean_mapping_frees_its_pages_and_keeps_its_bytes(tmp_path):
    """A private mapping nobody wrote to is the file: dropped, its pages leave the process and
    come back from the file when read. One written to keeps its pages (and the change)."""
    clean, written = tmp_path / "clean.bin", tmp_path / "written.bin"
    payload = os.urandom(4 << 20)
    clean.write_bytes(payload)
    written.write_bytes(payload)
    with open(clean, "rb") as one, open(written, "r+b") as other:
        first = mmap.mmap(one.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        second = mmap.mmap(other.fileno(), 0, flags=mmap.MAP_PRIVATE)
        try:
            assert first[:] == payload and second[:] == payload  # both read in
            second[0] = payload[0] ^ 0xFF  # a private change: not the file's any more
            assert _resident_kb(clean) >= 4096 and _resident_kb(written) > 0
            assert pages.drop_mapped(clean) == 4 << 20
            assert pages.drop_mapped(written) == 0
            assert _resident_kb(clean) == 0 and _resident_kb(written) > 0
            assert first[:] == payload  # read back from the file
            assert second[0] == payload[0] ^ 0xFF and second[1:] == payload[1:]
        finally:
            first.close()
            second.close()
    assert pages.drop_mapped(tmp_path / "absent.bin") == 0
