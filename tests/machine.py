"""How slow this machine is right now, for the subprocess timeouts of the tests (a loaded 2-core box is
many times slower than an idle one: no fixed wall-clock limit a busy machine exceeds)."""
import subprocess
import sys
import time

import pytest

_calibration = None
IDLE_TORCH_IMPORT_S = 2.0  # what `python -c "import torch"` takes on an idle developer machine


def slowness() -> float:
    """Seconds this machine takes, now, to start a Python that imports torch (measured once)."""
    global _calibration
    if _calibration is None:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
        _calibration = time.perf_counter() - t0
    return _calibration


def timeout(idle_seconds: float) -> float:
    """``idle_seconds`` (a generous bound on an idle machine), scaled by how much slower this one is now."""
    return idle_seconds * max(1.0, slowness() / IDLE_TORCH_IMPORT_S)


SGLANG_PINNED = "0.5.23"


def sglang_installed() -> bool:
    """Whether the SGLang the tests are written for is installed (``make test`` installs it; the GPU
    image of the device check has none)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang") == SGLANG_PINNED
    except PackageNotFoundError:
        return False


# For a test outside tests/sglang that runs SGLang's own code: skipped, with the reason, where it is not
# installed. In CI (CI set) every skip but a GPU test's fails the run (tests/conftest.py), so CI still runs it.
needs_sglang = pytest.mark.skipif(not sglang_installed(),
                                  reason=f"needs sglang=={SGLANG_PINNED}, not installed here (make test installs it)")

