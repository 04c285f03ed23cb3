"""Runs many ``python -m eagle3_ops`` command lines in ONE process (each test subprocess imports
torch: seconds on a loaded 2-core box), each through the same ``__main__.main`` that ``python -m
eagle3_ops`` runs, with real file descriptors: stdout is a pipe whose reader has closed (or a
file), stderr a file. Used by tests/test_cli.py:

    python tests/cli_driver.py CASES.json RESULTS.json

CASES: [{"argv": [...], "env": {...}, "stdout": "closed" | "file"}]; RESULTS: per case
{"rc", "stderr", "stdout"}. With a closed stdout, stdout is line-buffered, so a command meets the
closed pipe at its first line (as ``| head -c0`` does), not only at exit.
"""
import json
import logging
import os
import sys
import tempfile


def _logging_state():
    """What a command may configure on the way (importing SGLang installs a root handler with its own
    timestamped format): put back after each case, so the next one logs as a fresh process would."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]


def _restore_logging(state):
    known = {id(lg) for lg, *_ in state}
    for lg, handlers, level, propagate in state:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
    for lg in logging.Logger.manager.loggerDict.values():  # loggers created during the case
        if isinstance(lg, logging.Logger) and id(lg) not in known:
            lg.handlers[:] = []


def run_case(case, main):
    from eagle3_ops import qualify_cache, settings

    settings._reported.clear()  # once-per-process messages: each case is a fresh command
    qualify_cache._noted.clear()
    old_env = dict(os.environ)
    logging_state = _logging_state()
    os.environ.update(case.get("env", {}))
    saved_out, saved_err = os.dup(1), os.dup(2)
    err_file = tempfile.TemporaryFile()
    out_file = tempfile.TemporaryFile()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        if case["stdout"] == "closed":
            r, w = os.pipe()
            os.close(r)  # the reader is gone before anything is written
            os.dup2(w, 1)
            os.close(w)
            sys.stdout.reconfigure(line_buffering=True)
        else:
            os.dup2(out_file.fileno(), 1)
            sys.stdout.reconfigure(line_buffering=False)
        os.dup2(err_file.fileno(), 2)
        try:
            rc = main(list(case["argv"]))
        except BaseException as e:  # what would have been a traceback
            import traceback

            rc = f"raised {type(e).__name__}"
            traceback.print_exc()
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            rc = f"{rc} (and stdout still held unflushed output)"
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        os.environ.clear()
        os.environ.update(old_env)
        _restore_logging(logging_state)
    err_file.seek(0)
    out_file.seek(0)
    return {"rc": rc, "stderr": err_file.read().decode(errors="replace"),
            "stdout": out_file.read().decode(errors="replace")}


def main():
    import argparse

    ap = argparse.ArgumentParser(prog="python tests/cli_driver.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", metavar="CASES.json")
    ap.add_argument("results", metavar="RESULTS.json")
    a = ap.parse_args()
    sys.argv[1:] = [a.cases, a.results]
    cases = json.loads(open(sys.argv[1]).read())
    from eagle3_ops.__main__ import main as eagle3_ops_main

    results = [run_case(c, eagle3_ops_main) for c in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
