"""The per-scheme object store: whole objects by path, fsspec's vocabulary.

``ObjectStore`` is all that the rest of storage asks of a backend: ``exists``, ``read``,
``write_once``, ``stat`` (stored size and generation), ``delete`` (conditional on a generation where
the backend has one), ``list`` (and ``delete_tree`` for ``clear``), with builtin exceptions:
``FileNotFoundError`` for a missing object, ``FileExistsError`` when ``write_once`` finds the name
taken (another writer published first; the object stored is that writer's). Objects are
immutable: a name, once published, always holds the same complete bytes until deleted.

Backends:

- ``FsspecObjectStore``: any fsspec filesystem. ``write_once`` is ``pipe_file(mode="create")``:
  ``ifGenerationMatch=0`` on gcsfs (412 → ``FileExistsError``), exists-then-write on memory://.
- ``LocalObjectStore`` (file://): fsspec's local ``pipe_file(mode="create")`` is
  exists-then-write (two writers could both write, a reader could see a partial file), so
  ``write_once`` writes a unique temp name in the object's directory and publishes it with
  ``os.link``, which fails if the name exists. Temp names start with ``TMP_PREFIX`` and are never
  listed; a crashed writer's leftovers are removed by the byte-capped LRU's scan (``lru``).
- ``AsyncFsspecObjectStore`` (async filesystems: gcsfs): the same primitives as coroutines
  (``aexists`` ...) for ``batch_io.LoopBatchIO``, which runs them on the filesystem's event loop.
  A listing of a folder is one ``objects.list`` request (``_do_list_objects``; gcsfs' ``_find``
  sends a second, "as a file", when the folder is empty: every miss's index folder).
  Existence and ``stat`` of an object are one metadata request on gcsfs (``_get_object``: ``GET
  b/{bucket}/o/{name}``), not fsspec's ``_exists`` / gcsfs' ``_info``, which also list the
  object's prefix (a listing per check, slow on a large bucket); gcsfs itself falls back to a
  one-result listing only where the credentials may list but not get objects.
  gcsfs' own retries (up to 6 attempts with backoff of up to 32 s, "connection refused"
  included) are turned off (``own_retries``): the retry policy is ``batch_io``'s, inside each
  call's deadline.

Threads. The sync primitives run on ``batch_io``'s I/O threads (any number at once, on different
or equal paths); the coroutines on the filesystem's loop. No state of its own besides the fsspec
filesystem.
"""

from __future__ import annotations

import abc
import itertools
import os
import secrets
import shutil
import types
from typing import Any

import fsspec
import numpy as np
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

TMP_PREFIX = ".tmp-"
_TMP_TOKEN = secrets.token_hex(4)  # temp file names: unique across hosts sharing a directory
_TMP_SEQ = itertools.count()  # next() is atomic under the GIL


def object_bytes(header: bytes, payload: np.ndarray) -> bytes:
    """Header + payload as one ``bytes`` for backends that take a whole object: one copy of the
    payload (``header + payload.tobytes()`` would copy it twice)."""
    return b"".join((header, payload.reshape(-1).view(np.uint8).data))


class ObjectStore(abc.ABC):
    """Whole objects by path (paths as the fsspec filesystem names them: no protocol)."""

    fs: Any  # the fsspec filesystem

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def read(self, path: str) -> bytes | bytearray | memoryview:
        """The object's bytes; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def write_once(self, path: str, header: bytes, payload: np.ndarray) -> None:
        """Publish ``header + payload`` at ``path`` unless the name is taken (``FileExistsError``);
        readers see the whole object or none."""

    @abc.abstractmethod
    def delete(self, path: str, generation: str | None = None) -> None:
        """Remove the object; ``FileNotFoundError`` if there is none. ``generation`` (from
        ``stat``): only if the stored object is still that generation, where the backend can
        tell (gs://); elsewhere a plain delete."""

    def stat(self, path: str) -> tuple[int, str | None]:
        """(stored size, generation or None where the backend reports none)."""
        info = self.fs.info(path)
        return int(info["size"]), _generation(info)

    @abc.abstractmethod
    def list(self, prefix: str, first: int | None = None) -> list[str]:
        """Paths of the objects under directory ``prefix`` (recursive; [] if there is none;
        ``FileNotFoundError`` if the bucket is gone); ``first``: only the first that many in name
        order (on gcsfs: that many listed, so one request for a folder of thousands)."""

    @abc.abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (nothing there: no error)."""

    def list_dirs(self, prefix: str) -> tuple[str, ...]:
        """Names of the folders directly under ``prefix`` (none if there is no such folder): one listing."""
        return _dir_names(self.fs.ls(prefix, detail=True)) if self.fs.exists(prefix) else ()


class FsspecObjectStore(ObjectStore):
    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def exists(self, path: str) -> bool:
        # info, not fsspec's exists, which answers False for any error (a timeout is not "absent")
        try:
            self.fs.info(path)
        except FileNotFoundError:
            return False
        return True

    def read(self, path: str) -> bytes | bytearray | memoryview:
        return self.fs.cat_file(path)

    def write_once(self, path: str, header: bytes, payload: np.ndarray) -> None:
        self.fs.pipe_file(path, object_bytes(header, payload), mode="create")

    def delete(self, path: str, generation: str | None = None) -> None:
        self.fs.rm_file(path)

    def list(self, prefix: str, first: int | None = None) -> list[str]:
        return _first(_visible(self.fs.find(prefix)), first)  # (FileNotFoundError: the bucket is gone)

    def delete_tree(self, prefix: str) -> None:
        try:
            if self.fs.exists(prefix):
                self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass


def _dir_names(entries: list[dict[str, Any]]) -> tuple[str, ...]:
    """Base names of the folder entries of an ``ls(detail=True)``."""
    return tuple(e["name"].rstrip("/").rpartition("/")[2] for e in entries if e.get("type") == "directory")


def _first(paths: list[str], first: int | None) -> list[str]:
    """``paths`` (all), or the first ``first`` of them in name order."""
    return paths if first is None else sorted(paths)[:first]


def _visible(paths: list[str]) -> list[str]:
    """``paths`` without temp files."""
    return [p for p in paths if not os.path.basename(p).startswith(TMP_PREFIX)]


def _generation(info: dict[str, Any]) -> str | None:
    """The stored version an ``info()`` reports: gcsfs' ``generation``, else an ``etag``."""
    g = info.get("generation") or info.get("etag")
    return None if g is None else str(g)


def _create_tmp(d: str) -> tuple[int, str]:
    """A new, exclusively created temp file in directory ``d`` (created if missing), named unique
    per process (pid, a random token, a counter; ``O_EXCL`` settles the rest)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    made = False
    for _ in range(100):
        tmp = f"{d}/{TMP_PREFIX}{os.getpid()}-{_TMP_TOKEN}-{next(_TMP_SEQ)}"
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileNotFoundError:  # first object of this directory (or the tree was cleared)
            if made:
                raise
            os.makedirs(d, exist_ok=True)
            made = True
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp file name in {d}")


def write_all(fd: int, header: bytes, payload: np.ndarray) -> None:
    """Header then payload into the open file ``fd`` (closed here)."""
    with os.fdopen(fd, "wb") as f:
        f.write(header)
        f.write(payload.reshape(-1).view(np.uint8).data)


class LocalObjectStore(FsspecObjectStore):
    """file://: write-once by temp file + ``os.link`` (module docstring)."""

    def write_once(self, path: str, header: bytes, payload: np.ndarray) -> None:
        fd, tmp = _create_tmp(path.rpartition("/")[0])
        try:
            write_all(fd, header, payload)
            try:
                os.link(tmp, path)  # atomic; FileExistsError if another writer published first
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: an atomic rename unless stored
                if os.path.exists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
                tmp = ""
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def delete(self, path: str, generation: str | None = None) -> None:
        os.unlink(path)

    def stat(self, path: str) -> tuple[int, str | None]:
        return os.stat(path).st_size, None

    def list(self, prefix: str, first: int | None = None) -> list[str]:
        out: list[str] = []
        for d, _, files in os.walk(prefix):
            out += [os.path.join(d, f) for f in files if not f.startswith(TMP_PREFIX)]
        return _first(out, first)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(prefix, ignore_errors=True)


class AsyncFsspecObjectStore(FsspecObjectStore):
    """An async fsspec filesystem (gcsfs): the primitives also as coroutines, for its loop."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        # gcsfs, or a wrapper of it (which forwards ``_get_object``): object metadata in one request
        self._object_get = _is_gcsfs(fs) or _is_gcsfs(fs.__dict__.get("fs"))

    @property
    def loop(self) -> Any:
        return self.fs.loop

    async def _ainfo(self, path: str) -> dict[str, Any]:
        """The object's metadata (``FileNotFoundError`` if there is none), in one request where
        the backend allows (module docstring); a bucket (no ``/``) is the backend's ``_info``."""
        if self._object_get and "/" in path.strip("/"):
            return await self.fs._get_object(path)
        return await self.fs._info(path)

    async def aexists(self, path: str) -> bool:
        try:
            await self._ainfo(path)
        except FileNotFoundError:
            return False
        return True

    async def aread(self, path: str) -> bytes:
        return await self.fs._cat_file(path)

    async def awrite_once(self, path: str, header: bytes, payload: np.ndarray) -> None:
        await self.fs._pipe_file(path, object_bytes(header, payload), mode="create")

    async def astat(self, path: str) -> tuple[int, str | None]:
        info = await self._ainfo(path)
        return int(info["size"]), _generation(info)

    async def adelete(self, path: str, generation: str | None = None) -> None:
        fs = self.fs
        if generation is not None and _is_gcsfs(fs):  # ifGenerationMatch: a rewrite in between survives
            bucket, key, _ = fs.split_path(path)
            await fs._call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation)
        else:
            await fs._rm_file(path)

    async def alist(self, prefix: str, first: int | None = None) -> list[str]:
        if self._object_get:  # one objects.list request per 1000 names (``_find`` sends a second one when empty)
            folder = self.fs._strip_protocol(prefix).rstrip("/") + "/"  # (as listed names are)
            items, _ = await self.fs._do_list_objects(prefix, delimiter="", max_results=first)  # (in name order)
            return _first(_visible([o["name"] for o in items if o["name"].startswith(folder)]), first)
        return _first(_visible(await self.fs._find(prefix)), first)

    async def alist_dirs(self, prefix: str) -> tuple[str, ...]:
        try:
            return _dir_names(await self.fs._ls(prefix, detail=True))
        except FileNotFoundError:
            return ()

    async def adelete_tree(self, prefix: str) -> None:
        try:
            if await self.fs._exists(prefix):
                await self.fs._rm(prefix, recursive=True)
        except FileNotFoundError:
            pass


def own_retries(fs: Any) -> None:
    """Turn off gcsfs' internal retries on this instance (its ``_request`` without the retrying
    decorator): connection errors and 5xx then reach ``batch_io``, whose retries stop at the
    call's deadline. Also a wrapper's gcsfs target (``fs.fs``). Other filesystems (and gcsfs
    versions without the undecorated function) are left as they are; the deadline still cancels
    their retries."""
    target = fs.__dict__.get("fs")  # a wrapping filesystem's target, as fsspec's wrappers name it
    for f in (fs, target):
        plain = getattr(getattr(type(f), "_request", None), "__wrapped__", None)
        if _is_gcsfs(f) and callable(plain):
            f._request = types.MethodType(plain, f)


def _is_gcsfs(fs: Any) -> bool:
    return any(c.__name__ == "GCSFileSystem" for c in type(fs).__mro__)


# Filesystems whose calls stay on this host's own storage (a block device or memory): each call returns
# within the kernel's own I/O bounds, in microseconds. Anything else (NFS, SMB, FUSE such as gcsfuse,
# cluster filesystems) may hang on a network, and unknown types are treated like those.
LOCAL_FSTYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay",
                           "vfat", "exfat"})


def on_local_disk(path: str) -> bool:
    """Whether ``path`` lies on a filesystem of ``LOCAL_FSTYPES`` (its deepest mount point, from psutil)."""
    import psutil

    real = os.path.realpath(path)
    best, fstype = "", ""
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):  # (a later mount over the same point hides the earlier)
            best, fstype = mount, part.fstype
    return fstype in LOCAL_FSTYPES


def open_object_store(url: str, storage_options: dict[str, Any], fs: Any = None) -> tuple[ObjectStore, str]:
    """The object store for ``url`` and its root path (no protocol, no trailing slash). ``fs``: an
    fsspec filesystem to use instead of the one the URL names (tests)."""
    if fs is None:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    else:
        root = fs._strip_protocol(url)
    root = root.rstrip("/")
    if isinstance(fs, LocalFileSystem):
        os.makedirs(root, exist_ok=True)
        return LocalObjectStore(fs), root
    if isinstance(fs, AsyncFileSystem):
        own_retries(fs)
        return AsyncFsspecObjectStore(fs), root
    return FsspecObjectStore(fs), root
