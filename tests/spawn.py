"""``python -m eagle3_ops ARGS`` as a fresh process, without paying torch's import in each.

A test of the command line needs a real process: its own file descriptors, exit status, interpreter
shutdown (the last flush into a closed pipe) and once-per-process state. Starting one costs 4-9 s of
CPU on the loaded 2-core CI machine, nearly all of it importing torch, transformers and triton. So
each pytest worker keeps a server (this file run as a script; another one when the worker's own
environment changes in a variable read at import, the last two kept) that imports those (:data:`PRELOAD`) and nothing
of eagle3_ops (checked), then forks one child per command. The child takes the caller's
stdin/stdout/stderr (passed as file descriptors), environment and working directory, and runs
``eagle3_ops`` as ``__main__`` at the top level of the script, so it ends as ``python -m eagle3_ops``
ends: SystemExit's status, a traceback and status 1 for an uncaught exception, the interpreter's own
shutdown. The server runs no torch op (a thread pool started before a fork is lost in the child).

What a fork cannot give is what the preloaded modules read from the environment when imported
(``HF_MODULES_CACHE``, ``TORCH_*``, ...). So :func:`run` forks only when the command's environment
equals the server's except for variables read after start (:func:`_read_after_start`: eagle3_ops's
own, pytest's, the cache folder); otherwise it runs a real ``python -m eagle3_ops``. Either way the
caller gets what ``subprocess.run([sys.executable, "-m", "eagle3_ops", *args], ...)`` gives.
tests/test_spawn.py checks the two agree."""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "triton", "numpy", "safetensors.torch", "transformers", "transformers.configuration_utils",
           "transformers.models.auto.configuration_auto", "transformers.modeling_utils")
_HEADER = struct.Struct("!I")


# ---- the caller's side ---------------------------------------------------------------------------------
def base_env() -> Dict[str, str]:
    """The environment of a test's command: this process's, with the repository first on PYTHONPATH and
    no EAGLE3_OPS_DEBUG (a test that wants it sets it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("EAGLE3_OPS_DEBUG", None)
    return env


# Read when used, never when PRELOAD is imported (tests/test_spawn.py checks the first two): the cache
# folders importing SGLang points at its own (sglang.srt.environ.redirect_third_party_caches). CUDA reads
# CUDA_CACHE_PATH when it starts, which the server never does; FlashInfer and TileLang are not preloaded.
_READ_WHEN_USED = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR",
                   "FLASHINFER_WORKSPACE_BASE", "XDG_CACHE_HOME")


def _read_after_start(name: str) -> bool:
    """Variables none of PRELOAD reads when imported: eagle3_ops's (never preloaded), pytest's own and
    the cache folders above."""
    return name.startswith(("EAGLE3_OPS_", "PYTEST_")) or name in _READ_WHEN_USED


class _Server:
    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     cwd=str(ROOT))
        theirs.close()
        self._ready = False

    def wait_ready(self) -> None:
        if not self._ready:
            msg = _recv(self.sock)
            if msg != {"ready": True}:
                self.log.seek(0)
                raise RuntimeError(f"tests/spawn.py server did not start ({msg}):\n"
                                   + self.log.read().decode(errors="replace")[-4000:])
            self._ready = True

    def differs_from(self, env: Dict[str, str]) -> List[str]:
        """The variables, read at start, where ``env`` is not the server's (a fork needs none)."""
        return sorted(k for k in set(self.env) | set(env) if not _read_after_start(k) and self.env.get(k) != env.get(k))

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: Optional[_Server] = None  # the one the last command used
_servers: List[_Server] = []  # live servers, the most recently used last
_MAX_SERVERS = 2  # a test that changes the environment and changes it back needs no third start
counts = {"forked": 0, "subprocess": 0}  # how run() ran its commands (tests/test_spawn.py reads it)
last_difference: List[str] = []  # the variables that made the last real process one


def _get_server() -> _Server:
    """A server under this process's :func:`base_env` as it is now: started on first use, and again
    when that has changed in a variable read at import (importing SGLang's kernels sets some, e.g.
    CUTE_DSL_CACHE_DIR); the previous one is kept (up to _MAX_SERVERS), so an environment that comes
    back (a test's monkeypatch undone) finds its server. A caller's own variation on it never starts
    one: that command runs as a real process."""
    global _server
    env = base_env()
    _servers[:] = [s for s in _servers if s.proc.poll() is None]
    found = next((s for s in _servers if not s.differs_from(env)), None)
    if found is None:
        found = _Server(env)
        import atexit

        atexit.register(found.close)
        if len(_servers) >= _MAX_SERVERS:
            _servers.pop(0).close()
    else:
        _servers.remove(found)
    _servers.append(found)
    _server = found
    return found


def _fd_for(spec, ours: int, closers: List[int]):
    """(fd to pass, our read end or None) for a subprocess-style stdin (``ours`` 0), stdout (1) or
    stderr (2) argument: PIPE, DEVNULL, None (inherit ours), a file descriptor or a file."""
    if spec == subprocess.PIPE:
        if ours == 0:
            raise ValueError("tests/spawn.py: stdin=PIPE is not supported (no input to send)")
        r, w = os.pipe()
        closers.append(w)
        return w, r
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if ours == 0 else os.O_WRONLY)
        closers.append(fd)
        return fd, None
    if spec is None:
        return ours, None
    return (spec if isinstance(spec, int) else spec.fileno()), None


def run(args: Sequence, *, env: Optional[Dict[str, str]] = None, cwd=None, timeout: Optional[float] = None,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        module: str = "eagle3_ops") -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, timeout=timeout,
    stdin=stdin, stdout=stdout, stderr=stderr, text=True)`` (env: :func:`base_env` when None; cwd: the
    repository when None), forked from the server where that is the same."""
    args = [str(a) for a in args]
    env = base_env() if env is None else dict(env)
    cwd = os.path.abspath(cwd or ROOT)
    cmd = [sys.executable, "-m", module, *args]
    server = _get_server()
    difference = server.differs_from(env)
    if difference:
        counts["subprocess"] += 1
        last_difference[:] = difference
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, stdin=stdin, stdout=stdout, stderr=stderr,
                              text=True)
    server.wait_ready()
    counts["forked"] += 1
    closers: List[int] = []
    try:
        fd_in, _ = _fd_for(stdin, 0, closers)
        fd_out, out_r = _fd_for(stdout, 1, closers)
        fd_err, err_r = _fd_for(stderr, 2, closers)
        _send(server.sock, {"module": module, "argv": args, "env": env, "cwd": cwd}, [fd_in, fd_out, fd_err])
    finally:
        for fd in closers:
            os.close(fd)
    pid = _recv(server.sock)["pid"]
    return _collect(server, pid, cmd, timeout, out_r, err_r)


def _collect(server: _Server, pid: int, cmd, timeout, out_r, err_r) -> subprocess.CompletedProcess:
    """Read the child's pipes until its exit status arrives (and the pipes end); kill it at ``timeout``."""
    chunks = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        if fd is not None:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
    sel.register(server.sock, selectors.EVENT_READ)
    deadline = None if timeout is None else time.monotonic() + timeout
    status, killed = None, False
    try:
        while status is None or len(sel.get_map()) > 0:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0 and not killed and status is None:
                os.kill(pid, signal.SIGKILL)
                killed = True
            for key, _ in sel.select(timeout=None if killed else left):
                if key.fileobj is server.sock:
                    status = _recv(server.sock)["exit"]
                    sel.unregister(server.sock)
                    continue
                data = os.read(key.fileobj, 1 << 16)
                if data:
                    chunks[key.fileobj].append(data)
                else:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        for fd in (out_r, err_r):
            if fd is not None:
                os.close(fd)
    out = b"".join(chunks[out_r]).decode(errors="replace") if out_r is not None else None
    err = b"".join(chunks[err_r]).decode(errors="replace") if err_r is not None else None
    if killed:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, status, out, err)


def _send(sock: socket.socket, obj, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _recv(sock: socket.socket, want_fds: bool = False):
    """One message (None at end of stream); with ``want_fds``, (message, fds)."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 3)
    if len(head) < _HEADER.size:
        if head:
            head += _read_exact(sock, _HEADER.size - len(head))
        else:
            return (None, []) if want_fds else None
    (n,) = _HEADER.unpack(head)
    msg = json.loads(_read_exact(sock, n))
    return (msg, fds) if want_fds else msg


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("tests/spawn.py: the other side closed mid-message")
        buf += part
    return buf


# ---- the server's side ---------------------------------------------------------------------------------
def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("eagle3_ops", "flashinfer", "tilelang"))
    assert not leaked, f"preloading imported {leaked}: a forked command would not start fresh"
    import torch

    assert not torch.cuda.is_initialized(), "preloading started CUDA: a forked child cannot use it"


def _serve(sock: socket.socket):
    """Fork one child per request and report its pid, then its exit status; in the child, return the
    request (the child runs it at the top level of this script). Returns None when the caller is gone."""
    _preload()
    _send(sock, {"ready": True})
    while True:
        job, fds = _recv(sock, want_fds=True)
        if job is None:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            return job, fds
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():  # --help, or anything but the socket spawn.run passes
        print(f"usage: python tests/spawn.py SOCKET_FD\n\n{__doc__}")
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    _request = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _request is None:
        sys.exit(0)
    _job, _fds = _request
    for _target, _fd in enumerate(_fds):
        os.dup2(_fd, _target)
    for _fd in _fds:
        if _fd > 2:
            os.close(_fd)
    os.chdir(_job["cwd"])
    os.environ.clear()
    os.environ.update(_job["env"])
    import runpy

    sys.argv = ["-m", *_job["argv"]]  # run_module puts __main__.py's path first, as `python -m` does
    sys.path[0] = os.getcwd()         # `python -m` puts the working directory first on sys.path
    _module = _job["module"]
    del _request, _job, _fds
    runpy.run_module(_module, run_name="__main__", alter_sys=True)
