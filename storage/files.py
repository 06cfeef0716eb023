"""Facts about a file: whether it was rewritten since it was last read (without reading it), and the
digest of its bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

__all__ = ["file_stamp", "file_sha256"]


def file_stamp(path: str | Path) -> Optional[tuple[int, int, int]]:
    """(inode, size, mtime in ns) of ``path``, None if it is absent: a file written again in place
    or replaced by a rename gets another stamp, so a cache of what was read from it can key on it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def file_sha256(path: str | Path) -> str:
    """The sha256 of the file's bytes, as hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
