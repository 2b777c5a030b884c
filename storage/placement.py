"""Where a file:// store's fan-out directories go on ext2/3/4: spread over the block groups.

ext4 gives a new file an inode in its directory's block group, and a new directory one near its
parent, unless the parent is a *top directory* (``FS_TOPDIR_FL``, ``chattr +T``): the Orlov allocator
then spreads the parent's new subdirectories over groups with the most free inodes and blocks. An L3
root usually sits inside a busy directory (``/tmp``, a home or data directory), so without the flag
its fan-out directories share a few block groups with everything else created and deleted there.
Every L3 object and manifest entry is one new inode, and on this host creating one there cost
150-840 us of kernel CPU per file while other processes churned files (ext4 without a journal skips
each inode freed in the last ~30 s while it scans a group's bitmap), against 23-33 us in spread
directories at the same moments (12 alternating rounds of 100 creates each, over 100 s).

So ``FsspecStorage`` marks the parent of each fan-out a top directory before it makes the sixteen
directories (``_make_fanout``; an existing fan-out keeps its placement). Best effort: nothing happens
where the flag is unsupported (other filesystems, other systems, no permission); names, contents
and semantics are unchanged. Pure function of the path; no state.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys

FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h (the kernel reads and writes an int)
FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def _open_dir(path: str) -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def directory_flags(path: str) -> int | None:
    """The inode flags of directory ``path`` (``FS_IOC_GETFLAGS``), or None where unsupported."""
    fd = _open_dir(path)
    if fd is None:
        return None
    try:
        return struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def spread_subdirectories(path: str) -> bool:
    """Marks directory ``path`` a top directory (``FS_TOPDIR_FL``): directories made in it from now on
    are spread over the filesystem's block groups. True if the flag is set now; False (nothing
    changed, nothing raised) where the filesystem, the system or the permissions do not allow it."""
    fd = _open_dir(path)
    if fd is None:
        return False
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags | FS_TOPDIR_FL))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
