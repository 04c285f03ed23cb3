"""Command line: ``python -m eagle3_ops COMMAND [ARGS]``; the commands are :data:`COMMANDS`.

Every command: ``--help``; an unknown flag is argparse's usage and exit status 2; each bad or
unknown ``EAGLE3_OPS_*`` variable is one line on stderr at start (settings.report_problems, as the
SGLang plugin does); a closed stdout, an interrupt or a resource failure end it as _cli.py says
(exit statuses 0/1/2/3/130/141, docs/cli.md *Command line*).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

from . import _cli


@dataclass(frozen=True)
class Command:
    """One ``python -m eagle3_ops`` command: its name, its one-line summary for :func:`usage`, and the function that
    runs it."""
    name: str
    summary: str
    main: Callable[[List[str]], int]   # the arguments after the command's name -> exit status
    needs_backend: bool = False         # runs ops here: EAGLE3_OPS_BACKEND must be able to serve this machine


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m eagle3_ops {name}", description=description)


def _demo(argv: List[str]) -> int:
    _parser("demo", COMMANDS["demo"].summary).parse_args(argv)
    from .demos.ops_demo import main as demo_main

    return demo_main()


def _info(argv: List[str]) -> int:
    _parser("info", COMMANDS["info"].summary + " (one JSON object)").parse_args(argv)
    import eagle3_ops

    print(json.dumps({"build": eagle3_ops.build_info(), "backends": eagle3_ops.backends()}, indent=2))
    return 0


def _doctor(argv: List[str]) -> int:
    from .doctor.cli import main as doctor_main

    return doctor_main(argv)


def _capture_states(argv: List[str]) -> int:
    from .doctor.cli import capture_states_main

    return capture_states_main(argv)


def _qualify(argv: List[str]) -> int:
    from .qualify import main as qualify_main

    return qualify_main(argv)


def _spec_report(argv: List[str]) -> int:
    ap = _parser("spec-report", COMMANDS["spec-report"].summary + ". The JSON is what the SGLang plugin writes "
                 "next to the live wiring check's result; the GPU timings in it are that server's own.")
    ap.add_argument("json", nargs="?", help="the report's JSON (default: the newest spec_report*.json in the cache "
                                            "folder the plugin writes to)")
    args = ap.parse_args(argv)
    from pathlib import Path

    from .sglang.spec_report import render, result_path

    if args.json is not None:
        path = Path(args.json)
    else:
        found = sorted(result_path().parent.glob("spec_report*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            print(f"error: no speculation report in {result_path().parent} (the SGLang plugin writes one after "
                  f"1000 verified steps; pass the JSON's path)", file=sys.stderr)
            return _cli.EXIT_USAGE
        path = found[-1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"error: cannot read {path}: {e}", file=sys.stderr)
        return _cli.EXIT_USAGE
    for line in render(data):
        print(line)
    return _cli.EXIT_OK


COMMANDS: Dict[str, Command] = {c.name: c for c in (
    Command("demo", "stock vs eagle3_ops draft-input path on a random case (and SGLang, if installed)", _demo,
            needs_backend=True),
    Command("doctor", "check which hidden states an engine feeds an EAGLE-3 draft (--help for options)", _doctor),
    Command("capture-states", "record a target's hidden states for `doctor --replay` (--help for options)",
            _capture_states),
    Command("info", "build info and the backend serving each op on this machine", _info, needs_backend=True),
    Command("qualify", "check and time every candidate path at a model's shapes on this device (--help)", _qualify,
            needs_backend=True),
    Command("spec-report", "print a server's speculation report (acceptance per position, cycle times, best setting)",
            _spec_report),
)}


def usage() -> str:
    """The top-level help text: one line per command of :data:`COMMANDS`, then the exit statuses."""
    width = max(map(len, COMMANDS)) + 3
    lines = ["usage: python -m eagle3_ops COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {c.name:<{width}}{c.summary}" for c in COMMANDS.values()]
    return "\n".join(lines) + "\n\nexit status: 0 done, 1 doctor found errors, 2 bad usage or input, 3 out of " \
                             "memory or disk, 130 interrupted, 141 stdout closed by its reader"


def _backend_problem():
    """One line when EAGLE3_OPS_BACKEND cannot be used here (a bad value, or a backend that cannot
    serve this machine's device), else None."""
    import torch

    from . import dispatch, settings

    try:
        dispatch.forced_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dispatch.backends(device)
    except settings.SettingError as e:
        return str(e)
    except dispatch.BackendUnavailableError as e:
        return f"{e}"
    return None


def _dispatch(argv: List[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return _cli.EXIT_OK if argv else _cli.EXIT_USAGE
    cmd, rest = COMMANDS.get(argv[0]), argv[1:]
    if cmd is None:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return _cli.EXIT_USAGE
    if not {"-h", "--help"} & set(rest):
        if cmd.needs_backend:
            problem = _backend_problem()
            if problem is not None:
                print(f"error: {problem}", file=sys.stderr)
                return _cli.EXIT_USAGE
        from . import settings

        settings.report_problems(logging.getLogger("eagle3_ops"))  # one line per bad or unknown variable
    return cmd.main(rest)


def main(argv=None) -> int:
    """Entry point: runs the command named by ``argv`` (default ``sys.argv[1:]``) under ``_cli.run`` and returns its
    exit status."""
    return _cli.run(_dispatch, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
