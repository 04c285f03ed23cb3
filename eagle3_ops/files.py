"""How eagle3_ops replaces a file it writes (the qualification cache, STATES files): never half a
file, never another writer's temporary. Imports neither torch nor the rest of eagle3_ops."""
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
