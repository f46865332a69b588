"""Run the hf3fsctl CLI as `python -m hf3fsctl ARGS` does, from the session's CLI zygote
when it can: `run_hf3fsctl(*args)` returns the `subprocess.CompletedProcess` either way.

`warm` and `verify` run vLLM in their own process (importing it costs ~6-12 s on 2
cores, more under load), so the test session starts a CLI zygote (tests/conftest.py,
`hf3fsctl.vllm_tools.zygote`) that imported vLLM once with the environment `cli_env()`
gives a CLI run here, and forks a child per command: a fresh process to the store, with
its own environment, working directory, stdin from /dev/null and exit status. A command
it cannot take (another import-time environment, tensor parallel, `bench`, a zygote that
is gone) runs in `subprocess.run([sys.executable, "-m", "hf3fsctl", ...])` with the same
environment, so the two paths differ only in start-up time. (`bench e2e` runs its
engines through `run_engine`; their environment reserves a CPU, a `VLLM_` variable the
session's engine zygote was not started with, so tests/e2e hands the bench process the
reserved-CPU zygote in `ENGINE_ZYGOTE_SOCKET`: e2e conftest `reserved_cpu_zygote`.)

Tests that need a separate process on purpose (signals, `Popen`, start-up time, what a
fresh interpreter imports) start it themselves.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hf3fsctl.vllm_tools import zygote

CLI_ZYGOTE_ENV = "CLI_ZYGOTE_SOCKET"  # the CLI zygote's socket path; unset = fresh starts
# What `hf3fsctl warm` sets (setdefault) before it imports vLLM, given to every command so
# that the vLLM the zygote imported is configured as the command would configure it
# (`verify` sets the same stream; its level is then WARNING in both paths).
VLLM_LOGGING = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# Commands that run their engines through `runner.run_engine` (never vLLM in their own
# process): their environment stays as given, so that the engine zygote, started with the
# runner's, still takes those runs; the CLI zygote then does not take the command.
ENGINE_RUN_COMMANDS = ("bench",)
DEFAULT_TIMEOUT_S = 600.0


def cli_env(env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of `hf3fsctl ARGS`: `env` (default: this process's), vLLM logging to
    stderr unless set (not for `ENGINE_RUN_COMMANDS`), and no PYTHONHASHSEED (vLLM's block
    hashes must not depend on it)."""
    out = dict(os.environ if env is None else env)
    if not args or args[0] not in ENGINE_RUN_COMMANDS:
        for name, value in VLLM_LOGGING.items():
            out.setdefault(name, value)
    out.pop("PYTHONHASHSEED", None)
    return out


def _tensor_parallel(args: tuple[str, ...]) -> bool:
    """Whether `args` ask for more than one tensor-parallel rank (workers: start fresh)."""
    for flag, value in itertools.pairwise(args):
        if flag in ("--tensor-parallel-size", "-tp") and value != "1":
            return True
        name, _, size = value.replace(" ", "").partition("=")
        if flag == "--engine-arg" and name == "tensor_parallel_size" and size != "1":
            return True
    return any(a.startswith("--tensor-parallel-size=") and not a.endswith("=1") for a in args)


def zygote_can_run(args: tuple[str, ...], env: dict[str, str]) -> bool:
    """Whether the session's CLI zygote can run `hf3fsctl ARGS` with `env` as a fresh
    process would (tensor parallel starts workers, and runs fresh)."""
    path = os.environ.get(CLI_ZYGOTE_ENV)
    started_with = zygote.zygote_env(path) if path else None
    if started_with is None or _tensor_parallel(args):
        return False
    return zygote.same_import_env(env, started_with)


def run_hf3fsctl(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`python -m hf3fsctl ARGS` with `cli_env(env, args)`, its output captured as text.

    Args:
        env: the whole environment (default: this process's), as `subprocess.run` takes it.
        timeout: seconds before the command is killed and `subprocess.TimeoutExpired` raised.
        check: assert a zero exit status (the message ends with the command's stderr).
    """
    run_env = cli_env(env, args)
    command = [sys.executable, "-m", "hf3fsctl", *args]
    done = _run_forked(args, run_env, timeout) if zygote_can_run(args, run_env) else None
    if done is None:
        done = subprocess.run(
            command,
            env=run_env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if check:
        assert done.returncode == 0, (
            f"{' '.join(args)} exited {done.returncode}:\n" + (done.stderr[-3000:])
        )
    return done


def _run_forked(
    args: tuple[str, ...], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """The command in a child of the CLI zygote; None = the zygote is gone (run fresh)."""
    command = [sys.executable, "-m", "hf3fsctl", *args]
    path = os.environ[CLI_ZYGOTE_ENV]
    with tempfile.TemporaryDirectory(prefix="hf3fsctl-cli-") as tmp:
        try:
            done = zygote.run_forked(path, list(args), env, Path(tmp), timeout, module="hf3fsctl")
        except TimeoutError:
            stdout = zygote.read_text(Path(tmp) / "stdout.txt")
            stderr = zygote.read_text(Path(tmp) / "stderr.txt")
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
        except ConnectionError as exc:
            stderr = zygote.read_text(Path(tmp) / "stderr.txt")
            raise AssertionError(f"{' '.join(args)}: {exc}:\n{stderr[-3000:]}") from None
    if done is None:
        return None
    returncode, stdout, stderr = done
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)
