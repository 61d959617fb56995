"""Paths read from, and folders written for, checkpoints: containment of index entries and private temp folders.

    full = contained(folder, entry, index_path)   # an index's file entry, resolved inside its folder or refused
    tmp = temp_dir_beside(dst)                     # a new, exclusively created folder next to dst (no symlinks)
    set_user_mode(path)                            # the permissions any file the user writes gets (umask)
"""
from __future__ import annotations

import os
import tempfile

__all__ = ["contained", "set_user_mode", "temp_dir_beside"]


def contained(folder: str, entry: str, index: str) -> str:
    """`entry` (a file name read from `index`) joined to `folder`, resolved through symlinks; an absolute path or
    one that ends outside the folder is an error naming the entry: an index may only name its own files."""
    root = os.path.realpath(folder)
    full = os.path.realpath(os.path.join(root, entry))
    if os.path.isabs(entry) or os.path.commonpath([root, full]) != root or full == root:
        raise ValueError(f"{index}: entry {entry!r} names a file outside the index's folder {root} (resolved to "
                         f"{full}); an index may only name files in its own folder")
    return full


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_user_mode(path: str, *, folder: bool = False) -> None:
    """mkstemp / mkdtemp create 0600 / 0700; give the path the mode open() / mkdir() would (0666 / 0777 & ~umask)."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def temp_dir_beside(dst: str) -> str:
    """A fresh folder next to dst, created exclusively (mkdtemp: a random name, never an existing path or a link
    someone placed), with the user's usual folder mode; rename it onto dst when complete."""
    dst = os.path.abspath(dst.rstrip("/") or "/")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    set_user_mode(tmp, folder=True)
    return tmp
