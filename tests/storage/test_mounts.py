"""Where file:// existence checks run: inline only on a local filesystem (decided once from the
mount table), on the bounded pool path for network/FUSE/unknown mounts."""

from __future__ import annotations

import pytest
from hicache.storage.mounts import is_local_fs_type, mount_fs_type, stats_are_local

TABLE = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
server:/export /mnt/nfs nfs4 rw,hard 0 0
gcsfuse /mnt/bucket fuse.gcsfuse rw 0 0
/dev/vdb /mnt/nfs/local xfs rw 0 0
//host/share /mnt/my\\040share cifs rw 0 0
/dev/vdc /data ext4 rw 0 0
server:/other /data nfs rw 0 0
overlay /var/lib/docker/x overlay rw 0 0
"""


@pytest.mark.parametrize(
    "path,fstype",
    [
        ("/", "ext4"),
        ("/work/cache", "ext4"),
        ("/dev/shm/l3", "tmpfs"),
        ("/mnt/nfs", "nfs4"),
        ("/mnt/nfs/a/b", "nfs4"),
        ("/mnt/nfsx/a", "ext4"),  # a sibling with a common name prefix is not inside /mnt/nfs
        ("/mnt/nfs/local/l3", "xfs"),  # the longest mount point wins
        ("/mnt/bucket/l3", "fuse.gcsfuse"),
        ("/mnt/my share/l3", "cifs"),  # octal escapes in mount points
        ("/data/l3", "nfs"),  # two mounts on one point: the later one is on top
        ("/var/lib/docker/x/l3", "overlay"),
    ],
)
def test_mount_fs_type_picks_the_mount_holding_the_path(path, fstype):
    assert mount_fs_type(path, TABLE) == fstype


def test_local_decision_by_type():
    for t in ("ext4", "xfs", "btrfs", "tmpfs", "overlay"):
        assert is_local_fs_type(t)
    for t in ("nfs", "nfs4", "cifs", "smb3", "fuse.gcsfuse", "fuse.sshfs", "fuseblk", "9p", "ceph", "lustre", None, ""):
        assert not is_local_fs_type(t)
    assert mount_fs_type("/x", "") is None and not is_local_fs_type(mount_fs_type("/x", "garbage\n"))


def test_bad_path_is_a_value_error():
    with pytest.raises(ValueError, match="relative/dir"):
        mount_fs_type("relative/dir", TABLE)


def test_stats_are_local_reads_the_given_table(tmp_path):
    d = tmp_path / "root"
    d.mkdir()
    real = str(d.resolve())
    table = tmp_path / "mounts"
    table.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/x {real} nfs rw 0 0\n")
    assert not stats_are_local(str(d), str(table))
    table.write_text(f"/dev/vda / nfs rw 0 0\ntmpfs {real} tmpfs rw 0 0\n")
    assert stats_are_local(str(d), str(table))
    assert not stats_are_local(str(d), str(tmp_path / "no-such-table"))  # unreadable: not local
