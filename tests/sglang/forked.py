"""Fresh SGLang processes without paying SGLang's import in each: one parent imports SGLang's
model runner (10-15 s of CPU on the 2-core CI machine, most of a worker's cost) and nothing of
eagle3_ops, then forks one child per job; each child sets its own environment and runs its script
as ``__main__``, exactly where a fresh ``python SCRIPT ARGS`` would be after ``import sglang``.
No plugin is loaded and no eagle3_ops module imported before the fork (checked here), and the
parent runs no torch op of its own (a thread pool started before a fork is lost in the child), so
what a child tests (load_plugins, the patch sites, the ranks' collectives) starts from the state a
fresh process has.

    python forked.py JOBS.json

JOBS: ``[{"script": PATH, "argv": [...], "env": {...}, "out": PATH}]``; a child's stdout and stderr
both go to its ``out`` file; this process exits 0 once every child has ended and prints one JSON
line, each child's exit status in job order."""
import json
import os
import sys

# What every worker of tests/sglang imports first (the rest is cheap after these).
PRELOAD = ("torch", "sglang.srt.model_executor.model_runner", "sglang.srt.plugins")


def _preload():
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    leaked = sorted(m for m in sys.modules if m == "eagle3_ops" or m.startswith("eagle3_ops."))
    assert not leaked, f"importing SGLang imported {leaked}: a forked child would not start fresh"


def _child(job) -> None:
    fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 1
    try:
        import runpy

        os.environ.update(job.get("env", {}))
        script = os.path.abspath(job["script"])
        sys.argv = [script, *job.get("argv", [])]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(jobs_file: str) -> None:
    jobs = json.loads(open(jobs_file).read())
    _preload()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            _child(job)
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(codes))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # a test's worker script: its usage, nothing run
        print(f"usage: python tests/sglang/forked.py JOBS.json\n\n{__doc__}")
        sys.exit(0)
    main(sys.argv[1])
