"""The demos' table printer."""
from __future__ import annotations


def print_table(rows: list) -> None:
    """A GitHub-style table of dict rows (tabulate when installed)."""
    try:
        from tabulate import tabulate

        print(tabulate(rows, headers="keys", tablefmt="github"))
    except ImportError:
        keys = list(rows[0])
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(str(r[k]) for k in keys))
