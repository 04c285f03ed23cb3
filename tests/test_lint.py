"""The linter is configured (pyproject.toml ``[tool.ruff]``: line length 120, pycodestyle, pyflakes, bugbear)
and the repository is clean under it. ``make install`` installs ruff; a missing ruff fails here, it does not
skip (a skipped lint would hide every finding)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check . found:\n{proc.stdout}{proc.stderr}"


def test_ruff_is_configured_with_a_line_length():
    text = (ROOT / "pyproject.toml").read_text()
    assert "[tool.ruff]" in text and "line-length = 120" in text
