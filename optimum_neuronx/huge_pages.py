"""Host memory in 2 MiB pages (Linux transparent huge pages) for the weights that decode streams.

A memory-mapped export lives in the page cache, whose folios have whatever sizes the writes and the read-ahead
left, part of them 4 KiB pages, which decode streams slower than 2 MiB pages. Weights read into anonymous memory
advised MADV_HUGEPAGE land in 2 MiB pages wherever the kernel allows them.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path
from typing import Callable, Optional

import torch

HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
MADV_COLLAPSE = 25  # Linux >= 6.1; Python 3.11's mmap module has no name for it


def transparent_huge_pages(setting: str | Path = THP_SETTING) -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); "" where there is none (not
    Linux, or the file cannot be read)."""
    try:
        text = Path(setting).read_text()
    except OSError:
        return ""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else ""


def huge_pages_available() -> bool:
    """True where an MADV_HUGEPAGE mapping gets 2 MiB pages: Linux with transparent huge pages not "never"."""
    return hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed anonymous memory starting on a 2 MiB boundary, advised MADV_HUGEPAGE before it is first
    touched, as a uint8 tensor (its storage keeps the mapping alive)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


def collapse(buffer: torch.Tensor) -> None:
    """Ask the kernel to move `buffer`'s 4 KiB pages into huge pages now (MADV_COLLAPSE: it reclaims and compacts
    memory for them, where a page fault gives up and takes 4 KiB pages). Best effort: an older kernel refuses the
    advice, a fragmented memory leaves some pages small."""
    start = buffer.data_ptr() // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    end = -(-(buffer.data_ptr() + buffer.nbytes) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(start, end - start, MADV_COLLAPSE)


def settle(buffer: torch.Tensor, enough: float, make_room: Optional[Callable[[], None]] = None) -> float:
    """`buffer`'s share of huge pages (huge_page_share) once written. Below `enough`: after a collapse, and where
    still below, after `make_room()` (memory the caller can give back) and another collapse."""
    share = huge_page_share(buffer)
    if share < enough:
        collapse(buffer)
        share = huge_page_share(buffer)
    if share < enough and make_room is not None:
        make_room()
        collapse(buffer)
        share = huge_page_share(buffer)
    return share


def huge_page_share(buffer: torch.Tensor, smaps: str | Path = "/proc/self/smaps") -> float:
    """The share of `buffer`'s whole 2 MiB pages that sit in huge pages (huge_page_share_between)."""
    begin = buffer.data_ptr()
    return huge_page_share_between(begin, begin + buffer.nbytes, smaps)


def huge_page_share_between(begin: int, end: int, smaps: str | Path = "/proc/self/smaps") -> float:
    """The share of the whole 2 MiB pages of addresses [begin, end) that sit in huge pages: AnonHugePages (read
    into memory) plus FilePmdMapped (a file mapping's huge folios) of the mappings that overlap them, in smaps;
    1.0 for a span smaller than one huge page, 0.0 where smaps cannot be read."""
    whole = (end // HUGE_PAGE_BYTES - -(-begin // HUGE_PAGE_BYTES)) * HUGE_PAGE_BYTES
    if whole <= 0:
        return 1.0
    huge, inside = 0, False
    try:
        lines = Path(smaps).read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line: start-end ...
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            inside = low < end and begin < high
        elif inside and fields and fields[0] in ("AnonHugePages:", "FilePmdMapped:"):
            huge += int(fields[1]) * 1024
    return min(1.0, huge / whole)
