"""Which filesystem a local path lives on, and whether a ``stat`` there is safe on the caller.

``file://`` existence checks run on the calling (serving) thread when that cannot block without
bound: the root is on a local block or memory filesystem. A ``file://`` URL can also point into a
network or FUSE mount (NFS, CIFS, gcsfuse, sshfs ...), where a ``stat`` may hang for as long as
the server is gone; there the checks go to the backend's pool threads, bounded by the call's
deadline. Decided once, when the store is built, from ``/proc/mounts`` (Linux). Anything not
known to be local (another OS, an unreadable mount table, an unlisted type) counts as not local.
Pure functions; no state, no threads.
"""

from __future__ import annotations

import os
import re

# Local block-device and memory filesystems: a stat is a page-cache / inode-cache lookup, never a
# wait on a remote server. ``overlay`` (containers) stacks local directories.
LOCAL_FS_TYPES = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs",
     "tmpfs", "ramfs", "overlay", "vfat", "exfat", "ntfs3"}
)
PROC_MOUNTS = "/proc/mounts"

_OCTAL = re.compile(r"\\([0-7]{3})")  # /proc/mounts escapes space, tab, newline, backslash


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_fs_type(path: str, mounts: str) -> str | None:
    """Filesystem type of the mount holding absolute ``path``, from the text of a mount table in
    ``/proc/mounts`` format (``device mountpoint fstype options ...`` per line). The longest
    mount point containing ``path`` wins; of several mounts on the same point, the last one
    (the one on top). ``None`` if no line matches."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"path must be an absolute path str, got {path!r}")
    best, best_len = None, -1
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape(fields[1]).rstrip("/") or "/", fields[2]
        inside = point == "/" or path == point or path.startswith(point + "/")
        if inside and len(point) >= best_len:
            best, best_len = fstype, len(point)
    return best


def is_local_fs_type(fstype: str | None) -> bool:
    """True for filesystem types where a ``stat`` cannot wait on a remote server (``fuse*``,
    ``nfs*``, ``cifs``, ``9p``, ... and unknown types are not)."""
    return fstype in LOCAL_FS_TYPES


def stats_are_local(path: str, mounts_file: str = PROC_MOUNTS) -> bool:
    """Whether existing directory ``path`` lies on a local filesystem (see the module docstring);
    False when the mount table cannot be read."""
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as f:
            table = f.read()
    except OSError:
        return False
    return is_local_fs_type(mount_fs_type(os.path.realpath(path), table))
