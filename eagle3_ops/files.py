"""How eagle3_ops replaces a file it writes (the qualification cache, STATES files): never half a
file, never another writer's temporary; and how an OS error is named in a message (the errno's name,
the system's words, the path). Imports neither torch nor the rest of eagle3_ops."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def replace_atomically(target: Path, write: Callable[[str], None], suffix: str = ".tmp") -> None:
    """``write(temporary path)``, then rename the temporary over ``target``. The temporary is a
    fresh file beside ``target`` (mkstemp: unique per writer, whether another process or another
    thread), so readers see the old file or the new one; on any failure (a full disk) it is
    removed and ``target`` is as it was."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def errno_name(e: BaseException) -> str:
    """The symbolic name of an OS error's errno (``ENOSPC``), or '' where it has none."""
    import errno

    code = getattr(e, "errno", None)
    return errno.errorcode.get(code, "") if isinstance(code, int) else ""


def os_error_words(e: BaseException) -> str:
    """What the system says and the errno's name: ``No space left on device (ENOSPC)``; for an
    exception that is not an OS error, its own message."""
    if not isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    words = e.strerror or (str(e).strip() or type(e).__name__)
    name = errno_name(e)
    return f"{words} ({name})" if name else words


def os_error_text(e: BaseException, path=None) -> str:
    """``ENOSPC (No space left on device) on /the/path``: the errno's name, the system's words, the path
    (``path``, else the error's own filename)."""
    if not isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    name = errno_name(e)
    words = e.strerror or (str(e).strip() or type(e).__name__)
    where = path if path is not None else e.filename
    head = f"{name} ({words})" if name else words
    return f"{head} on {where}" if where else head
