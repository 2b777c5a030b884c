"""``NameFilter``: which object names a file:// store may hold, answered from shared memory.

A miss is the common answer of an L3 existence query (every new prompt asks), and on the serving
thread one ``stat`` right after a model forward costs tens of microseconds (the kernel's code and
data are cold then; measured here: ~90-150 us after a 32 MiB pass vs ~5 us warm). The filter
answers "not stored" with a memory read and no system call: a byte map of ``nbytes`` slots in a
file beside the store's objects (``{root}/v{FORMAT_VERSION}/{fingerprint[:16]}.names``), mapped
shared by every process that opens the store on this host. A name sets two slots (from XXH3-64 of
the name relative to the store's base, both in one 4 KiB page of the map) before its object or
link is created; a name whose slots are not both set was never written by any of them, so the store
answers a miss without the stat. Set slots are only a "maybe" (checked with the ``stat`` as
before): names deleted later (LRU eviction, corrupt objects) keep their slots, and other names
share slots (false positives grow with the names stored: ~1% at 100k names in 4 MiB, ~10% at 400k;
a full map costs nothing but the stats it no longer saves).

Only for a root on a local filesystem (``mounts.stats_are_local``): every writer is a process on
this host, so the shared mapping is one page-cache copy that all of them see. Slots are whole bytes
written with one store each (no read-modify-write): concurrent writers never lose each other's
slots. The file is made (sparse) by the first store that opens the root; that store then adds the
names of objects already there (written by a store without the filter). It lives outside the
store's base directory, so ``clear`` (which deletes the base) zeroes it in place instead: a
process that still maps it keeps seeing the same bytes.

Who owns what: the ``FsspecStorage`` that opened it owns the mapping and closes it; the file is
shared by every store on the root and is never deleted by this code.
"""

from __future__ import annotations

import mmap
import os

import xxhash


_PAGE_BITS = 12  # 4 KiB pages
_IN_PAGE = (1 << _PAGE_BITS) - 1


class NameFilter:
    """Shared byte map of possibly stored names (see the module docstring)."""

    def __init__(self, path: str, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4096 or nbytes & (nbytes - 1):
            raise ValueError(f"nbytes must be a power of two >= 4096, got {nbytes!r}")
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | os.O_EXCL, 0o644)
            self.created = True
        except FileExistsError:
            fd = os.open(path, flags, 0o644)
            self.created = False
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:  # made now, or by a store with a smaller map: the file's size decides
                os.ftruncate(fd, nbytes)  # (sparse; concurrent openers truncate to the same size)
                size = nbytes
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.nbytes = size
        self._page_mask = (size >> _PAGE_BITS) - 1

    def _slots(self, name: str) -> tuple[int, int]:
        """Two byte slots of ``name``, in one page of the map (one page touched per name: on a
        shared file mapping every first touch of a page, and every first write after the kernel
        wrote it back, is a page fault)."""
        h = xxhash.xxh3_64_intdigest(name.encode())
        page = (h & self._page_mask) << _PAGE_BITS
        return page | ((h >> 32) & _IN_PAGE), page | ((h >> 48) & _IN_PAGE)

    def add(self, names: list[str] | tuple[str, ...]) -> None:
        """Mark ``names`` (call before their objects or links are created)."""
        mm = self._mm
        for name in names:
            a, b = self._slots(name)
            mm[a] = 1
            mm[b] = 1

    def may_contain(self, name: str) -> bool:
        """False: no store on this root ever wrote ``name``; True: maybe (ask the filesystem)."""
        a, b = self._slots(name)
        mm = self._mm
        return bool(mm[a] and mm[b])

    def clear(self) -> None:
        """Every slot unset, in place (every process mapping the file sees it)."""
        self._mm[:] = bytes(self.nbytes)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
