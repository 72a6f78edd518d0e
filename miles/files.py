"""Files and folders someone else may control: names read from a file, folders a test writes to.

The rules, each one function (or class) every reader and writer shares:

- `resolve_inside(folder, entry)`: a relative name read from a file (a checkpoint index, a
  manifest, a dataset listing) is a path inside `folder`: never absolute, never `..`, and
  never a symlink whose target leaves the folder (`links_within` widens where a link may
  point, e.g. a Hugging Face snapshot's links into its repository's blob store).
  `check_name(name)`: a name a user gives for one entry of a folder (a model, a run) is one
  plain name, so it never leaves the folder either.
- `refuse_overlap(output, inputs)`: a step never writes an output that is, lies inside or
  contains one of its inputs, by resolved path and by folder identity (device, inode).
- `read_regular(path, limit)`: another program's output is read only from a regular file
  and never past `limit` bytes; a FIFO, a device (/dev/zero), a socket or, with
  follow=False, a symlink is refused at once instead of blocking or filling memory.
- `Folder`: a directory held open by descriptor. Files are created in it exclusively
  (O_EXCL | O_NOFOLLOW) and replaced by renaming a new file over the name, so a link or a
  hard link planted under that name is replaced, never written through; a folder is
  removed only when it is the very one (device, inode) its creator recorded.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FileRefused(ValueError):
    """A path or file broke one of the rules above; the message names it, the rule and a fix."""


def check_relative(entry: object, *, what: str = "entry") -> tuple[str, ...]:
    """The parts of `entry` if it is a plain relative path (the text alone; no file is touched)."""
    if not isinstance(entry, str) or not entry:
        raise FileRefused(f"{what} {entry!r} must be a non-empty relative path")
    shown = entry.encode("unicode_escape").decode("ascii")
    if "\0" in entry or "\\" in entry:
        raise FileRefused(f"{what} {shown!r} holds a NUL or a backslash; write a relative path with '/'")
    if entry.startswith("/"):
        raise FileRefused(f"{what} {shown!r} is an absolute path; it must name a file inside the folder")
    parts = tuple(entry.split("/"))
    if ".." in parts:
        raise FileRefused(
            f"{what} {shown!r} climbs outside the folder with '..'; it must name a file inside it"
        )
    if any(part in ("", ".") for part in parts):
        raise FileRefused(f"{what} {shown!r} has an empty or '.' part; write a plain relative path")
    try:
        entry.encode("utf-8")
    except UnicodeEncodeError:
        raise FileRefused(f"{what} {shown!r} is not valid UTF-8 text") from None
    return parts


def resolve_inside(
    folder: Path | str, entry: object, *, what: str = "entry", links_within: Path | str | None = None
) -> Path:
    """`folder / entry`, once `entry` is a plain relative path that, symlinks followed, stays
    inside `folder` (or inside `links_within`, where links may point); else FileRefused.

    The entry need not exist yet; whatever part of it exists is resolved."""
    check_relative(entry, what=what)
    folder = Path(folder)
    path = folder / str(entry)
    scope = os.path.realpath(links_within if links_within is not None else folder)
    real = os.path.realpath(path)
    if not _within(real, scope):
        raise FileRefused(
            f"{what} {entry!r} resolves to {real}, outside {scope} (a symlink leaves the folder); "
            "copy the file into the folder instead of linking it"
        )
    return path


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_name(name: object, *, what: str = "name") -> str:
    """`name` if it is one plain folder or file name (no '/', not '.', '..' or hidden, no
    control character); else FileRefused. For names a user gives that become one entry of a
    folder (a model name, a run id), so they can never leave it or shadow its bookkeeping."""
    check_relative(name, what=what)
    shown = str(name).encode("unicode_escape").decode("ascii")
    if "/" in str(name):
        raise FileRefused(
            f"{what} {shown!r} holds a '/'; it names one entry of its folder, give a plain name"
        )
    if str(name).startswith("."):
        raise FileRefused(
            f"{what} {shown!r} starts with '.'; hidden names are the tools' own, give a plain name"
        )
    if not str(name).isprintable():
        raise FileRefused(f"{what} {shown!r} holds a control character; give a plain name")
    return str(name)


def overlap(output: Path | str, source: Path | str) -> str | None:
    """How `output` and `source` share files: "is", "lies inside", "contains", or None.

    Compared by resolved path (symlinks followed) and by the (device, inode) of each existing
    folder on the way up, so a second name for the same folder (a bind mount) is caught too."""
    out, src = os.path.realpath(output), os.path.realpath(source)
    if out == src:
        return "is"
    if _within(out, src):
        return "lies inside"
    if _within(src, out):
        return "contains"
    out_self, out_chain = _identities(out)
    src_self, src_chain = _identities(src)
    if out_self is not None and out_self == src_self:
        return "is"
    if src_self is not None and src_self in out_chain:
        return "lies inside"
    if out_self is not None and out_self in src_chain:
        return "contains"
    return None


def _identities(real: str) -> tuple[tuple[int, int] | None, list[tuple[int, int]]]:
    """(device, inode) of `real` (None when it does not exist), and of it and every existing
    folder above it."""
    chain: list[tuple[int, int]] = []
    own, path = None, real
    while True:
        try:
            info = os.stat(path)
            chain.append((info.st_dev, info.st_ino))
            if path == real:
                own = chain[-1]
        except OSError:
            pass
        parent = os.path.dirname(path)
        if parent == path:
            return own, chain
        path = parent


def refuse_overlap(output: Path | str, sources, *, what: str = "output") -> None:
    """FileRefused when `output` is, lies inside or contains one of `sources` (see overlap):
    writing it could replace or delete what is being read."""
    for source in sources:
        how = overlap(output, source)
        if how is not None:
            raise FileRefused(
                f"{what} {output} {how} the input {source} (resolved: {os.path.realpath(output)} and "
                f"{os.path.realpath(source)}); writing it would replace what it reads: choose an output "
                "outside its input"
            )


def read_regular(path: Path | str, limit: int, *, follow: bool = True, what: str = "file") -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; FileRefused for anything
    else (a FIFO or device is refused before any read, so nothing blocks), OSError when it
    cannot be opened. With follow=False a symlink is refused too."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and exc.errno == 40 and os.path.islink(path):  # ELOOP: the name is a link
            raise FileRefused(f"{what} {path} is a symlink; only a regular file is read") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{what} {path} is {_kind(info.st_mode)}, not a regular file; it is not read")
        if info.st_size > limit:
            raise FileRefused(f"{what} {path} is {info.st_size} bytes, over the {limit}-byte limit")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while being read
                raise FileRefused(f"{what} {path} is over the {limit}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
    ):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def create_new(path: Path | str, mode: int = 0o644):
    """Open a file that did not exist for binary writing (never through a link or over a file)."""
    return os.fdopen(os.open(path, _NEW_FILE_FLAGS, mode), "wb")


def replace_file(path: Path | str, data: bytes, *, mode: int = 0o644, fsync: bool = False) -> None:
    """Write `data` to a new file beside `path` and rename it over `path`: a link or hard link
    under that name is replaced, never written through, and a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with create_new(tmp, mode) as fh:
            os.fchmod(fh.fileno(), mode)  # exactly `mode`, whatever the umask
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path | str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


class Folder:
    """A directory held open by descriptor; names are resolved against it, never re-walked,
    so a folder swapped for a link after opening does not redirect a write."""

    def __init__(self, path: Path | str, fd: int):
        self.path = Path(path)
        self.fd = fd

    @classmethod
    def open(cls, path: Path | str, *, create: bool = False) -> Folder:
        """The directory `path` (its parents created when `create`); its own name may be a
        link a person made, the names inside it are then never followed."""
        path = Path(path)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(path, os.open(path, _DIR_FLAGS))

    def identity(self) -> tuple[int, int]:
        info = os.fstat(self.fd)
        return info.st_dev, info.st_ino

    def subfolder(self, name: str, *, exclusive: bool = False) -> Folder:
        """The folder `name` inside this one, made if absent; FileRefused when `name` is a
        link or not a folder, FileExistsError when `exclusive` and it exists."""
        check_relative(name, what="folder name")
        fd = self.fd
        parts = name.split("/")
        try:
            for index, part in enumerate(parts):
                last = index == len(parts) - 1
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    if last and exclusive:
                        raise
                try:
                    child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (20, 40):  # ENOTDIR, ELOOP: a file or a link took the name
                        raise FileRefused(
                            f"{self.path / '/'.join(parts[: index + 1])} is a link or a file, not a "
                            "folder this run made; it is not followed"
                        ) from None
                    raise
                if fd != self.fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != self.fd:
                os.close(fd)
            raise
        return Folder(self.path / name, fd)

    def create(self, name: str, mode: int = 0o644):
        """A new file `name` in this folder, open for binary writing (exclusive, no link)."""
        check_relative(name, what="file name")
        return os.fdopen(os.open(name, _NEW_FILE_FLAGS, mode, dir_fd=self.fd), "wb")

    def replace(self, name: str, data: bytes, *, mode: int = 0o644) -> Path:
        """Write `data` as a new file renamed over `name` (see replace_file); returns its path."""
        check_relative(name, what="file name")
        tmp = f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with self.create(tmp, mode) as fh:
                fh.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            _unlink(tmp, self.fd)
            raise
        return self.path / name

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def remove_folder(self, name: str, identity: tuple[int, int]) -> bool:
        """Delete the folder `name` and everything in it if it is the one whose (device, inode)
        is `identity`; a link there is never followed. Returns whether it was deleted."""
        info = self.lstat(name)
        if info is None or not stat.S_ISDIR(info.st_mode) or (info.st_dev, info.st_ino) != tuple(identity):
            return False
        shutil.rmtree(name, dir_fd=self.fd)
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
