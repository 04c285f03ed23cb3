"""Command line: ``python -m eagle3_ops {demo|doctor|capture-states|info}``."""
from __future__ import annotations

import json
import sys

USAGE = """usage: python -m eagle3_ops COMMAND [ARGS]

commands:
  demo             stock vs eagle3_ops draft-input path on a random case (and SGLang, if installed)
  doctor           check which hidden states an engine feeds an EAGLE-3 draft (--help for options)
  capture-states   record a target's hidden states for `doctor --replay` (--help for options)
  info             build info and the backend serving each op on this machine
  qualify          check and time every candidate path at a model's shapes on this device (--help)
"""


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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "qualify" and not ({"-h", "--help"} & set(rest)):
        problem = _backend_problem()
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        from .qualify import main as qualify_main

        return qualify_main(rest)
    if cmd == "qualify":
        from .qualify import main as qualify_main

        return qualify_main(rest)
    if cmd in ("demo", "info"):
        problem = _backend_problem()
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if cmd == "demo":
        from .demos.ops_demo import main as demo_main

        return demo_main()
    if cmd == "doctor":
        from .doctor.cli import main as doctor_main

        return doctor_main(rest)
    if cmd == "capture-states":
        from .doctor.cli import capture_states_main

        return capture_states_main(rest)
    if cmd == "info":
        import eagle3_ops

        print(json.dumps({"build": eagle3_ops.build_info(), "backends": eagle3_ops.backends()}, indent=2))
        return 0
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
