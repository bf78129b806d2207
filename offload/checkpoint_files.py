"""Checkpoint directories and files that a crash cannot tear: the new version is written completely beside
the old one, then switched in with one atomic step; loads verify what they read.

A save (:func:`begin_save` ... :meth:`CheckpointWriter.commit`, or the :func:`saving` context) writes every
file into a temporary directory next to the checkpoint (``<name>.tmp-<host>-<pid>-<token>``, same parent,
so the same file system), through a writer that counts each file's bytes and its CRC-32 as they go, fsyncs
each file, writes ``manifest.json`` (every file's name, size and CRC-32) last, fsyncs the directory, and
then switches:

- where the file system can (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs, btrfs, tmpfs, ...), the new
  directory and the old checkpoint swap names in one system call, so the path names the old complete
  checkpoint until that call and the new one after it; the old one is then removed;
- elsewhere, the old checkpoint is renamed aside (``<name>.old-...``) and the new one renamed into place.
  A kill between the two renames leaves no directory at the path, but both complete versions beside it:
  the next load or save finds that and renames the newer complete one back (:func:`open_checkpoint`).

So a kill at any moment leaves the old or the new checkpoint, complete, never a mix. What a killed save
left (its temporary directory, a renamed-aside old version) is removed by the next save or load of the same
path, once its owner process is gone (same host, dead pid). Directories and files get the modes the
user's umask gives (``0o777`` / ``0o666`` masked), as ``mkdir`` and ``open`` would.

Loads (:func:`open_checkpoint`) check each file they use against the manifest before reading it: the size
always, the CRC-32 unless ``verify_checksums=False``; a missing, truncated or altered file raises
:class:`DamagedFileError` naming it. Checkpoints written before manifests existed load unverified, their
damaged JSON or torch files still refused with the file named. A load that finds a new version switched
in before it has read every file raises :class:`CheckpointReplacedError` rather than combine two versions
(:meth:`CheckpointFiles.check_unchanged`).

Single files (``.npy`` tables) are written the same way by :func:`write_file_atomically`: a temporary
file beside the target, fsynced, renamed over it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import os
import re
import secrets
import shutil
import socket
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

__all__ = [
    "MANIFEST",
    "CheckpointFiles",
    "CheckpointReplacedError",
    "CheckpointWriter",
    "DamagedFileError",
    "FileRecord",
    "begin_save",
    "open_checkpoint",
    "remove_orphans",
    "saving",
    "write_file_atomically",
]

MANIFEST = "manifest.json"
"""The file, written last into every checkpoint directory, that lists its files with sizes and CRC-32s."""

_MANIFEST_FORMAT = "offload.checkpoint_files/1"
_CHUNK = 1 << 20


class DamagedFileError(ValueError):
    """A checkpoint's file is missing, truncated, altered or unreadable; the message names the file."""


class CheckpointReplacedError(RuntimeError):
    """Another process saved a new version of the checkpoint while this one was loading it; load it again."""


# ---- names of what a save leaves beside the checkpoint ----------------------------------------------------
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _sibling(path: str, kind: str) -> str:
    return f"{path}.{kind}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


_SIBLING = re.compile(r"\.(?P<kind>tmp|old)-(?:(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}|(?P<legacy_pid>\d+))")


def _siblings(path: str) -> list[tuple[str, str, bool]]:
    """``(path, kind, owner_alive)`` for each temporary or renamed-aside copy of ``path`` a save made.

    Names without a host are those of the save before manifests (``<name>.tmp-<pid>``); they are taken as
    this host's. An owner on another host is taken as alive: nothing here can tell.
    """
    parent, name = os.path.split(path)
    try:
        entries = os.listdir(parent or ".")
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        if not entry.startswith(name + "."):
            continue
        match = _SIBLING.fullmatch(entry[len(name):])
        if match is None:
            continue
        host, pid = match["host"], int(match["pid"] or match["legacy_pid"])
        alive = _pid_alive(pid) if host in (None, _host()) else True
        out.append((os.path.join(parent, entry), match["kind"], alive))
    return out


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remove_orphans(path: str | os.PathLike) -> list[str]:
    """Remove what killed saves of ``path`` left beside it (temporary and renamed-aside copies whose owner
    process is gone), once ``path`` itself exists; returns the paths removed."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return []
    removed = []
    for sibling, _, alive in _siblings(path):
        if not alive:
            _remove(sibling)
            removed.append(sibling)
    return removed


def _recover(path: str) -> None:
    """Put a complete version back at ``path`` when a save was killed between its two renames (file systems
    without an atomic exchange): the new one if its manifest was written, else the old one."""
    if os.path.lexists(path):
        return
    dead = [(p, kind) for p, kind, alive in _siblings(path) if not alive and os.path.isdir(p)]
    new = [p for p, kind in dead if kind == "tmp" and os.path.isfile(os.path.join(p, MANIFEST))]
    old = [p for p, kind in dead if kind == "old"]
    for candidate in new + old:
        with contextlib.suppress(FileNotFoundError):
            os.rename(candidate, path)  # another process may have recovered it first
            _fsync_directory(os.path.dirname(path) or ".")
            return


# ---- durability ------------------------------------------------------------------------------------------
def _fsync_directory(path: str) -> None:
    if sys.platform == "win32":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


# ---- writing ---------------------------------------------------------------------------------------------
class _CountingWriter(io.RawIOBase):
    """A binary file that counts the bytes written through it and their CRC-32."""

    def __init__(self, file: IO[bytes], checksum: bool) -> None:
        super().__init__()
        self._file = file
        self._checksum = checksum
        self.size = 0
        self.crc32 = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.size += len(view)
        if self._checksum:
            self.crc32 = zlib.crc32(view, self.crc32)
        return len(view)


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as its manifest lists it."""

    size: int
    crc32: int


def _write_synced(path: str, write: Callable[[IO[bytes]], Any], checksum: bool = True) -> FileRecord:
    with open(path, "xb") as file:
        counting = _CountingWriter(file, checksum)
        write(counting)
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(counting.size, counting.crc32)


class CheckpointWriter:
    """The temporary directory of one save of the checkpoint directory :attr:`path`.

    Write each file with :meth:`write` (or :meth:`write_bytes`, :meth:`write_json`, :meth:`torch_save`),
    then :meth:`commit` (or :meth:`abort`). Several processes may write files into one save
    (:attr:`directory` is on storage they share); one of them commits with every process's records.
    """

    def __init__(self, path: str, directory: str) -> None:
        self.path = path
        self.directory = directory
        self.records: dict[str, FileRecord] = {}

    def write(self, name: str, write: Callable[[IO[bytes]], Any]) -> FileRecord:
        """Write file ``name`` by ``write(file)`` (a binary file object), fsynced; returns its record."""
        if name == MANIFEST or os.path.basename(name) != name or name in self.records:
            raise ValueError(f"cannot write {name!r} into a checkpoint: a plain file name written once, "
                             f"not {MANIFEST!r}")
        record = _write_synced(os.path.join(self.directory, name), write)
        self.records[name] = record
        return record

    def write_bytes(self, name: str, data: bytes) -> FileRecord:
        """Write ``data`` as the file ``name`` of the new version (see :meth:`write`)."""
        return self.write(name, lambda f: f.write(data))

    def write_json(self, name: str, value: Any) -> FileRecord:
        """Write ``value`` as the JSON file ``name`` of the new version (see :meth:`write`)."""
        return self.write_bytes(name, json.dumps(value, indent=1).encode())

    def torch_save(self, name: str, value: Any) -> FileRecord:
        """Write ``value`` with :func:`torch.save` as the file ``name`` of the new version (see :meth:`write`)."""
        return self.write(name, lambda f: torch.save(value, f))

    def commit(self, records: dict[str, FileRecord] | None = None) -> None:
        """Write the manifest of ``records`` (default: the files this writer wrote), then switch the
        checkpoint to this version in one atomic step and remove the old one."""
        records = self.records if records is None else records
        manifest = {"format": _MANIFEST_FORMAT, "checksum": "crc32",
                    "files": {name: {"size": r.size, "crc32": r.crc32} for name, r in sorted(records.items())}}
        _write_synced(os.path.join(self.directory, MANIFEST),
                      lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_directory(self.directory)
        parent = os.path.dirname(self.path) or "."
        if not os.path.lexists(self.path):
            os.rename(self.directory, self.path)
            _fsync_directory(parent)
            return
        if _exchange(self.directory, self.path):
            _fsync_directory(parent)
            shutil.rmtree(self.directory, ignore_errors=True)  # the old version, under the temporary name
            return
        aside = _sibling(self.path, "old")
        os.rename(self.path, aside)
        os.rename(self.directory, self.path)
        _fsync_directory(parent)
        shutil.rmtree(aside, ignore_errors=True)  # what is left, the next save or load removes

    def abort(self) -> None:
        """Remove the temporary directory; the checkpoint stays as it was."""
        shutil.rmtree(self.directory, ignore_errors=True)


def begin_save(path: str | os.PathLike, *, markers: Iterable[str] = ()) -> CheckpointWriter:
    """Start a save of the checkpoint directory ``path``: recover or clean what killed saves left, then make
    the temporary directory beside it.

    An existing ``path`` is replaced only if it is a checkpoint: a directory that is empty, holds a
    :data:`MANIFEST`, or holds one of ``markers`` (the files by which checkpoints written before manifests
    are known, ``"meta.json"`` for instance); anything else is refused rather than deleted.
    """
    path = os.path.abspath(os.fspath(path))
    _recover(path)
    remove_orphans(path)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"{path} exists and is not a checkpoint directory; refusing to replace it")
        names = set(os.listdir(path))
        if names and not names & {MANIFEST, *markers}:
            raise FileExistsError(f"{path} is a directory of other files (no {MANIFEST}"
                                  f"{''.join(', ' + m for m in markers)}); refusing to replace it with a checkpoint")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    directory = _sibling(path, "tmp")
    os.mkdir(directory)  # 0o777 masked by the umask, where tempfile.mkdtemp would give 0o700
    return CheckpointWriter(path, directory)


@contextlib.contextmanager
def saving(path: str | os.PathLike, *, markers: Iterable[str] = ()) -> Iterator[CheckpointWriter]:
    """``with saving(path) as writer: writer.write(...)``: commits when the block ends, aborts if it raises."""
    writer = begin_save(path, markers=markers)
    try:
        yield writer
        writer.commit()
    except BaseException:
        writer.abort()  # the temporary directory, or the old version if the switch happened
        raise


def write_file_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Write the file ``path`` by ``write(file)`` into a temporary file beside it, fsync it and rename it over
    ``path``: a reader sees the old file or the new one, whole. Temporary files of killed writes of the same
    path are removed first."""
    path = os.path.abspath(os.fspath(path))
    for sibling, kind, alive in _siblings(path):
        if kind == "tmp" and not alive:
            _remove(sibling)
    partial = _sibling(path, "tmp")
    try:
        _write_synced(partial, write, checksum=False)  # no manifest keeps it
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    _fsync_directory(os.path.dirname(path))


# ---- reading ---------------------------------------------------------------------------------------------
class CheckpointFiles:
    """A checkpoint directory opened for reading (:func:`open_checkpoint`): each file is checked against the
    manifest when first used, so a reader that needs some files (a rank its models) checks only those."""

    def __init__(self, path: str, manifest: dict[str, Any] | None, verify_checksums: bool) -> None:
        self.path = path
        self.manifest = manifest
        self.verify_checksums = verify_checksums
        self._checked: set[str] = set()
        self._identity = _identity(path)

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointReplacedError` if a save has switched a new version in at :attr:`path`
        since this checkpoint was opened: call it after reading every file and before using what was read,
        so that files of two versions are never combined."""
        if _identity(self.path) != self._identity:
            raise CheckpointReplacedError(f"{self.path} was replaced by another save while it was being loaded; "
                                          "load it again")

    def file(self, name: str) -> str:
        """The path of file ``name``, after checking it (size, and CRC-32 unless turned off)."""
        try:
            return self._file(name)
        except DamagedFileError:
            self.check_unchanged()  # a file of the next version is not damage
            raise

    def read_bytes(self, name: str) -> bytes:
        """File ``name``'s content, checked as :meth:`file` checks it (in the same read)."""
        try:
            return self._read_bytes(name)
        except DamagedFileError:
            self.check_unchanged()
            raise

    @property
    def verified(self) -> bool:
        """Whether the checkpoint has a manifest (those saved before manifests existed have none)."""
        return self.manifest is not None

    def _file(self, name: str) -> str:
        full = os.path.join(self.path, name)
        if name in self._checked:
            return full
        if self.manifest is None:
            if not os.path.isfile(full):
                raise DamagedFileError(f"{full} is missing from the checkpoint")
        else:
            record = self._record(name)
            size = _size(full)
            if size != record["size"]:
                raise DamagedFileError(f"{full} is damaged: {size} bytes where the checkpoint's manifest "
                                       f"says {record['size']} (truncated or overwritten)")
            if self.verify_checksums and "crc32" in record:
                with open(full, "rb") as f:
                    crc = 0
                    while chunk := f.read(_CHUNK):
                        crc = zlib.crc32(chunk, crc)
                self._check_crc(name, crc)
        self._checked.add(name)
        return full

    def _read_bytes(self, name: str) -> bytes:
        full = os.path.join(self.path, name)
        if self.manifest is None or name in self._checked:
            return _read(full)
        record = self._record(name)
        data = _read(full)
        if len(data) != record["size"]:
            raise DamagedFileError(f"{full} is damaged: {len(data)} bytes where the checkpoint's manifest "
                                   f"says {record['size']} (truncated or overwritten)")
        if self.verify_checksums and "crc32" in record:
            self._check_crc(name, zlib.crc32(data))
        self._checked.add(name)
        return data

    def read_json(self, name: str) -> Any:
        """File ``name`` parsed as JSON; a file that is not valid JSON raises :class:`DamagedFileError`."""
        data = self.read_bytes(name)
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            self.check_unchanged()
            raise DamagedFileError(f"{os.path.join(self.path, name)} is damaged: not valid JSON ({err})") from err

    def torch_load(self, name: str, **kwargs: Any) -> Any:
        """File ``name`` read by ``torch.load(..., weights_only=True, **kwargs)``; a file torch cannot read
        raises :class:`DamagedFileError`."""
        data = self.read_bytes(name)
        try:
            return torch.load(io.BytesIO(data), weights_only=True, **kwargs)
        except (RuntimeError, EOFError, OSError, ValueError) as err:
            self.check_unchanged()
            raise DamagedFileError(f"{os.path.join(self.path, name)} is damaged: torch cannot read it "
                                   f"({type(err).__name__}: {err})") from err

    def forget_checksums(self, names: Iterable[str]) -> None:
        """Drop the CRC-32 of files about to be modified in place (a table memory-mapped ``"r+"``), rewriting
        the manifest atomically; their sizes stay checked."""
        if self.manifest is None:
            return
        files = self.manifest["files"]
        changed = False
        for name in names:
            changed |= files.get(name, {}).pop("crc32", None) is not None
        if changed:
            write_file_atomically(os.path.join(self.path, MANIFEST),
                                  lambda f: f.write(json.dumps(self.manifest, indent=1).encode()))

    def _record(self, name: str) -> dict[str, int]:
        assert self.manifest is not None
        record = self.manifest["files"].get(name)
        if record is None:
            raise DamagedFileError(f"{os.path.join(self.path, name)}: the checkpoint's manifest lists no such "
                                   f"file (it has {sorted(self.manifest['files'])})")
        return record

    def _check_crc(self, name: str, crc: int) -> None:
        record = self._record(name)
        if crc != record["crc32"]:
            raise DamagedFileError(f"{os.path.join(self.path, name)} is damaged: its CRC-32 is {crc:#010x}, the "
                                   f"checkpoint's manifest says {record['crc32']:#010x} (bytes were altered); "
                                   "pass verify_checksums=False to load it anyway")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing from the checkpoint") from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DamagedFileError(f"{path} is missing from the checkpoint") from None


def open_checkpoint(path: str | os.PathLike, *, verify_checksums: bool = True) -> CheckpointFiles:
    """Open the checkpoint directory ``path`` for reading, after recovering from a save killed mid-switch and
    removing what killed saves left beside it (see the module's docstring).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        DamagedFileError: its manifest is unreadable.
    """
    path = os.path.abspath(os.fspath(path))
    _recover(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist or is not a directory: no checkpoint there")
    remove_orphans(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        return CheckpointFiles(path, None, verify_checksums)
    try:
        manifest = json.loads(_read(manifest_path))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedFileError(f"{manifest_path} is damaged: not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        raise DamagedFileError(f"{manifest_path}: expected format {_MANIFEST_FORMAT!r}, got "
                               f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    return CheckpointFiles(path, manifest, verify_checksums)
