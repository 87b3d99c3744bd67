"""Reading and writing the user's files: regular files only, reads bounded in size.

A size from stat() bounds nothing for /dev/zero (0 bytes, endless) and a FIFO blocks the
reader until a writer comes: both are refused before they are opened, and a read stops one
byte past its limit whatever stat() said.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from hybridlm.errors import InputError


def read_bytes(path: str | os.PathLike, what: str, *, max_bytes: int) -> bytes:
    """The file's bytes; InputError (one line naming `what` and the path) for a missing or
    unreadable file, a folder, a device, a FIFO or socket, or more than max_bytes."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise InputError(f"{what} {path}: is a directory, expected a file")
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} {path}: not a regular file (a device, FIFO or socket)")
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} {path}: more than {max_bytes:,} bytes; the limit is {max_bytes:,}")
    return data


def read_text(path: str | os.PathLike, what: str, *, max_bytes: int) -> str:
    """read_bytes as UTF-8 text (an encoding error is one line naming the byte)."""
    data = read_bytes(path, what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


OWN_STREAMS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/")
LINK_REFUSAL = "{path}: a symbolic link; an output is not written through a link (give the target's path)"


def writable(path: str | os.PathLike) -> str | None:
    """Why the path cannot be written as an output file, or None. Opens it to be sure (as root,
    os.access says yes to /proc); a file this check creates is removed again."""
    path = Path(path).expanduser()
    parent = path.parent
    if path.is_symlink() and not str(path).startswith(OWN_STREAMS):  # (before anything opens it: not its target)
        return LINK_REFUSAL.format(path=path)
    if path.is_dir():
        return f"{path} is a directory, expected a file path"
    if not parent.exists():
        return f"directory {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is not a directory, so {path.name} cannot be written under it"
    existed = path.exists()
    if existed:
        mode = path.stat().st_mode
        own = str(path).startswith(OWN_STREAMS)  # a pipe this process already holds has its reader
        if (stat.S_ISFIFO(mode) and not own) or stat.S_ISSOCK(mode):
            return f"{path} is not a regular file (a FIFO or socket would block the writer)"
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return f"{path} cannot be written ({exc.strerror or exc})"
    if not existed:
        try:
            path.unlink()
        except OSError:
            pass
    return None


def creatable_folder(path: str | os.PathLike) -> str | None:
    """Why the folder cannot be made (or written into) as an output folder, or None. The
    nearest existing ancestor must be a folder a file can be created in."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory, so {path} cannot be made under it"
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        return f"{path} cannot be written ({ancestor}: {exc.strerror or exc})"
    return None


def output_flags(path: str | os.PathLike) -> int:
    """open(2)'s flags for an output file: created or truncated, never through a symbolic link (a link
    planted where an output goes would have the run overwrite its target), except this process's own
    streams (/dev/stdout is a link to them)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    return flags if str(path).startswith(OWN_STREAMS) else flags | getattr(os, "O_NOFOLLOW", 0)


def refusal(path: str | os.PathLike, what: str, exc: OSError) -> InputError:
    """The one line for an output that cannot be opened."""
    if exc.errno == errno.ELOOP:
        return InputError(f"{what} {LINK_REFUSAL.format(path=path)}")
    return InputError(f"{what} {path}: cannot be written ({exc.strerror or exc})")


def write_output(path: str | os.PathLike, text: str, what: str) -> None:
    """Text into a new or truncated output file, never through a symbolic link (InputError, one line)."""
    try:
        fd = os.open(path, output_flags(path), 0o666)
    except OSError as exc:
        raise refusal(path, what, exc) from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
