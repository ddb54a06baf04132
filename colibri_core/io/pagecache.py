"""Keeping the page cache honest: dropping the pages of bytes colibri has read, so the
kernel does not quietly keep the model in memory and make the RAM budget a lie."""

from __future__ import annotations

import os

ALIGN = 4096  # O_DIRECT offset, length and buffer alignment (the common logical block size)
_FADVISE = hasattr(os, "posix_fadvise")


def forget(fd: int, offset: int, nbytes: int) -> None:
    """posix_fadvise(DONTNEED) over whole pages covering the range: the kernel only drops
    pages lying entirely inside the range it is given."""
    if _FADVISE:
        lo = offset - offset % ALIGN
        os.posix_fadvise(fd, lo, -(-(offset + nbytes - lo) // ALIGN) * ALIGN, os.POSIX_FADV_DONTNEED)


def drop_page_cache(path: str) -> None:
    """Ask the kernel to forget a file's cached pages (posix_fadvise DONTNEED)."""
    if not _FADVISE:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
