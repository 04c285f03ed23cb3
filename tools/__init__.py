"""Maintainer tools: run from a source checkout (``python -m tools.<name>``), never shipped in the
eagle3_ops package and never imported by it."""
