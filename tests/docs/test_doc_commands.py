"""Every shell command in README.md, docs/*.md and deploy/**/*.md runs here, or its page
says why not; every relative link of those pages names a file (and heading) of the
repository; every `hf3fsctl COMMAND --flag` they write in code (spans, fences, the
README's CLI block) is one the CLI has, and the CLI block lists them all.

How a page's commands run (one test per page, in the page's order):

- The commands come from the page's fenced `bash`, `sh`, `shell` and `console` blocks
  (tests/helpers/doc_commands.py). Each runs alone in `bash -o pipefail -c`, so only
  files pass from one command to the next, and must exit 0, or N where its comment says
  `# exits N`.
- Paths of a real machine (`/etc/hf3fsctl`, `/var/lib/hf3fsctl`, `/mnt/3fs`, …) become
  the same paths under a per-host sandbox root; `/etc/hf3fsctl/config.yaml` there is
  what the config search finds (`$HF3FSCTL_CONFIG`), as the real file would be. The
  working directory is a copy of the repository whose `deploy/systemd/` files carry the
  same substitutions, so `install deploy/systemd/config.yaml /etc/hf3fsctl/` installs a
  config pointing into the sandbox. The unit's `hf3fsctl` user is the test's user.
- `hf3fsctl serve` (and `redis-server`) start in the background on a free loopback port
  that stands for 18765 (6379) in every command and config of the page, `0.0.0.0` and
  `meta-host` become 127.0.0.1; the test waits until they answer, and at the end of the
  page stops them with SIGTERM and expects exit 0.
- `.venv/bin` (the interpreter running the tests) comes first on PATH.

A command that cannot run here is marked in the Markdown itself, with the reason
(docs/README.md, "Commands in the docs"):

    <!-- not run: REASON -->          on the line before a fence: the whole block
    some command   # not run: REASON  a comment of the command: that command
    some command   # exits 2          the status the doc shows (default 0)
    <!-- docs test: host NAME -->     before a fence: the block runs on another host

So a new command in the docs that fails fails this test until it is fixed or marked.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import doc_commands
from helpers.doc_commands import MAIN_HOST, ROOT, Command, Sandbox, substitute
from helpers.servers import free_port

COMMAND_TIMEOUT_S = 120
SERVICE_TIMEOUT_S = 30
# Programs beyond bash and coreutils that the pages' commands use, and what installs them
# (`make test` runs the Makefile targets). Missing outside CI, a command needing one is
# skipped with a warning; under CI (`$CI` set) it fails.
PROGRAMS = {
    "promtool": "make promtool",
    "redis-server": "make redis",
    "openssl": "apt-get install openssl",
    "curl": "apt-get install curl",
}
SERVICES = re.compile(r"^(?:\w+=\S+\s+)*(?P<program>hf3fsctl serve|redis-server|redis-sentinel)\b")
# What the repository copy of a sandbox leaves out: VCS, the venv, caches, build output.
NOT_COPIED = {".git", ".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build", "dist"}


@dataclass
class Service:
    command: Command
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class PageRun:
    """The sandbox of one page, its running services, and what went wrong."""

    sandbox: Sandbox
    services: list[Service] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ran: int = 0

    def fail(self, command: Command, why: str, output: str = "") -> None:
        tail = output[-3000:].rstrip()
        self.failures.append(f"{command}\n  -> {why}" + (f"\n{tail}" if tail else ""))


def _venv_bin() -> Path:
    venv = ROOT / ".venv" / "bin"
    return venv if (venv / "hf3fsctl").exists() else Path(sys.executable).parent


def _repository_copy(run: PageRun, host: str) -> Path:
    """The working directory of a host's commands: the repository, `deploy/systemd/`
    with the sandbox's paths and ports."""
    copy = run.sandbox.root(host) / "repo"
    if copy.exists():
        return copy
    copy.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in NOT_COPIED or entry.name == "deploy":
            continue
        (copy / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "deploy", copy / "deploy")
    for path in (copy / "deploy" / "systemd").iterdir():
        path.write_text(substitute(path.read_text(), run.sandbox, host))
    return copy


def _environment(run: PageRun, host: str) -> dict[str, str]:
    root = run.sandbox.root(host)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF3FSCTL_")}
    env |= {
        "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(root / "home"),
        "XDG_CONFIG_HOME": str(root / "home" / ".config"),
        "XDG_CACHE_HOME": str(root / "home" / ".cache"),
        "HF3FSCTL_STATE_DIR": str(root / "tmp" / "hf3fsctl-state"),
        "COLUMNS": "120",
    }
    config = run.sandbox.path(host, "/etc/hf3fsctl/config.yaml")
    if config.exists():  # what the search path finds on a real machine
        env["HF3FSCTL_CONFIG"] = str(config)
    return env


def _missing_program(text: str) -> str | None:
    for program, target in PROGRAMS.items():
        if re.search(rf"(?<![\w-]){program}\b", text) and shutil.which(program) is None:
            return f"{program} is not installed (`{target}` installs it)"
    return None


def _wait_until_up(service: Service, port: int, program: str) -> str | None:
    """None once the service answers, else why it did not."""
    deadline = time.monotonic() + SERVICE_TIMEOUT_S
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            return f"exited with {service.process.returncode} instead of serving"
        try:
            if program == "hf3fsctl serve":
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    return None
            else:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return None
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    return f"did not answer on 127.0.0.1:{port} in {SERVICE_TIMEOUT_S} s"


def _start_service(run: PageRun, command: Command, text: str, program: str) -> None:
    host = command.host
    log = run.sandbox.root(host) / "tmp" / f"service-{command.line}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", text],
            cwd=_repository_copy(run, host),
            env=_environment(run, host),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    service = Service(command, process, log)
    run.services.append(service)
    role = "serve" if program == "hf3fsctl serve" else "redis"
    port_flag = re.search(r"--port\s+(\d+)", text)
    port = int(port_flag[1]) if port_flag else run.sandbox.ports[role]
    if (why := _wait_until_up(service, port, program)) is not None:
        run.fail(command, why, log.read_text(errors="replace"))


def _stop_services(run: PageRun) -> None:
    for service in reversed(run.services):
        if service.process.poll() is None:
            os.killpg(service.process.pid, signal.SIGTERM)
            try:
                service.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(service.process.pid, signal.SIGKILL)
                service.process.wait()
                run.fail(service.command, "did not stop within 20 s of SIGTERM")
                continue
            if service.process.returncode != 0:
                output = service.log.read_text(errors="replace")
                run.fail(
                    service.command,
                    f"exited with {service.process.returncode} on SIGTERM (expected 0)",
                    output,
                )
        else:
            run.fail(service.command, f"had exited with {service.process.returncode}")


def run_command(run: PageRun, command: Command) -> None:
    """Run one command of the page (or start it, if it is a service)."""
    if command.not_run is not None:
        return
    text = substitute(command.text, run.sandbox, command.host)
    if (missing := _missing_program(text)) is not None:
        if os.environ.get("CI"):
            run.fail(command, missing)
        else:
            warnings.warn(f"{command}: skipped, {missing}", stacklevel=1)
        return
    run.ran += 1
    if (service := SERVICES.match(text)) is not None:
        _start_service(run, command, text, service["program"])
        return
    process = subprocess.Popen(
        ["bash", "-o", "pipefail", "-c", text],
        cwd=_repository_copy(run, command.host),
        env=_environment(run, command.host),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout ends everything the command started
    )
    try:
        output, _ = process.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        run.fail(command, f"still running after {COMMAND_TIMEOUT_S} s", output)
        return
    if process.returncode != command.status:
        run.fail(
            command, f"exited with {process.returncode}, the doc expects {command.status}", output
        )


def run_page(page: Path, directory: Path, root: Path = ROOT) -> PageRun:
    """Run every command of `page` (relative to `root`) in a sandbox under `directory`."""
    sandbox = Sandbox(directory, {"serve": free_port(), "redis": free_port()})
    sandbox.mount  # noqa: B018 - the shared mount exists before the first command
    run = PageRun(sandbox)
    try:
        for command in doc_commands.commands(page, root):
            run_command(run, command)
    finally:
        _stop_services(run)
    return run


# --- the pages ---------------------------------------------------------------------------


@pytest.mark.parametrize("page", doc_commands.pages(), ids=str)
def test_every_command_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    run = run_page(page, tmp_path)
    assert not run.failures, "\n\n".join(run.failures)


def test_the_pages_have_commands_and_every_skip_says_why() -> None:
    found = [c for page in doc_commands.pages() for c in doc_commands.commands(page)]
    assert {c.page for c in found} >= {"README.md", "docs/operations.md", "deploy/README.md"}
    assert sum(c.not_run is None for c in found) >= 10
    assert all(len(c.not_run.strip()) > 5 for c in found if c.not_run is not None)


# --- the runner itself: a failing command fails it ---------------------------------------


def write_page(root: Path, text: str) -> Path:
    (root / "page.md").write_text(text)
    return Path("page.md")


def test_the_extractor_joins_lines_and_reads_markers_and_prompts(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        "<!-- docs test: host node -->\n```bash\n# a comment\nhf3fsctl init \\\n"
        "  --storage-path /mnt/3fs/kv   # exits 3\necho '{\"a\":\n  1}'\n```\n\n"
        "```console\n$ hf3fsctl stats   # not run: needs a store\nstore  ...\n```\n",
    )
    assert [
        (c.line, c.text, c.host, c.not_run, c.status) for c in doc_commands.commands(page, tmp_path)
    ] == [
        (4, "hf3fsctl init \\\n  --storage-path /mnt/3fs/kv   # exits 3", "node", None, 3),
        (6, "echo '{\"a\":\n  1}'", "node", None, 0),
        (11, "hf3fsctl stats   # not run: needs a store", "main", "needs a store", 0),
    ]


def test_substitution_moves_paths_users_ports_and_hosts_into_the_sandbox(tmp_path: Path) -> None:
    sandbox = Sandbox(tmp_path, {"serve": 40001, "redis": 40002})
    text = (
        "sudo -u hf3fsctl hf3fsctl init --config /etc/hf3fsctl/config.yaml && "
        "scp meta-host:/etc/hf3fsctl/token /etc/hf3fsctl/token && "
        "curl http://meta-host:18765/healthz --host 0.0.0.0 /mnt/3fs/kv /etc/hf3fsctl-x"
    )
    main, node = tmp_path / MAIN_HOST, tmp_path / "node"
    assert substitute(text, sandbox, "node") == (
        f"hf3fsctl init --config {node}/etc/hf3fsctl/config.yaml && "
        f"cp {main}/etc/hf3fsctl/token {node}/etc/hf3fsctl/token && "
        f"curl http://127.0.0.1:40001/healthz --host 127.0.0.1 {main}/mnt/3fs/kv /etc/hf3fsctl-x"
    )


def test_a_failing_command_fails_the_page_and_a_marked_one_does_not(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        "```bash\ntrue\nfalse\nfalse   # exits 1\nfalse   # not run: shows a refusal\n```\n"
        "<!-- not run: a block that needs systemd -->\n```sh\nfalse\n```\n"
        "```python\nraise SystemExit(1)\n```\n",
    )
    run = run_page(page, tmp_path / "sandbox", root=tmp_path)
    assert run.ran == 3
    assert [f.splitlines()[0] for f in run.failures] == ["page.md:3: false"]


def test_commands_share_files_and_see_the_sandbox_not_the_machine(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        "```sh\ninstall -d /etc/hf3fsctl /var/lib/hf3fsctl/kv\n"
        "echo 'storage: {path: /var/lib/hf3fsctl/kv}' > /etc/hf3fsctl/config.yaml\n"
        'test "$HF3FSCTL_CONFIG" = /etc/hf3fsctl/config.yaml\n'
        "test -d /mnt/3fs && test -f deploy/systemd/config.yaml\n"
        "grep -q 'path: /var/lib/hf3fsctl/kv' deploy/systemd/config.yaml\n```\n",
    )
    run = run_page(page, tmp_path / "sandbox", root=tmp_path)
    assert (run.ran, run.failures) == (5, [])
    root = tmp_path / "sandbox" / MAIN_HOST
    assert (root / "var/lib/hf3fsctl/kv").is_dir()
    assert "storage" in (root / "etc/hf3fsctl/config.yaml").read_text()


def test_a_serve_command_is_started_on_loopback_and_stopped(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        "```bash\ninstall -d /mnt/3fs/kv\nhf3fsctl init --storage-path /mnt/3fs/kv --write-config /etc/hf3fsctl/config.yaml\n"
        "hf3fsctl serve --host 0.0.0.0 --port 18765\n"
        "curl -fsS http://127.0.0.1:18765/healthz\n```\n",
    )
    run = run_page(page, tmp_path / "sandbox", root=tmp_path)
    assert (run.ran, run.failures) == (4, [])
    assert [s.process.returncode for s in run.services] == [0]


# --- hf3fsctl's commands and flags as the docs write them ------------------------------


def cli_tree() -> Any:
    """The CLI's click command tree (Typer's), read in process: commands and their flags."""
    import typer

    from hf3fsctl.cli.main import app

    return typer.main.get_command(app)


def flags_of(command: Any) -> dict[str, str]:
    """Every spelling of every option of `command` -> the option's name."""
    return {o: p.name for p in command.params for o in (*p.opts, *p.secondary_opts)}


def wrong_cli_mentions(pages: list[Path], root: Path = ROOT) -> list[str]:
    tree = cli_tree()
    common = flags_of(tree) | {"--help": "help", "-h": "help"}
    wrong = []
    for page in pages:
        for mention in doc_commands.cli_mentions(page, root):
            command, words = tree, []
            for word in mention.command:
                if word not in getattr(command, "commands", {}):
                    break
                command, words = command.commands[word], [*words, word]
            where = f"{mention.page}:{mention.line}: hf3fsctl {' '.join(mention.command)}"
            if not words or (hasattr(command, "commands") and mention.flags):
                wrong.append(f"{where}: no such command")
                continue
            unknown = [f for f in mention.flags if f not in flags_of(command) | common]
            if unknown:
                wrong.append(f"{where}: no option {', '.join(unknown)}")
    return wrong


def test_every_hf3fsctl_command_and_flag_the_docs_write_exists() -> None:
    wrong = wrong_cli_mentions(doc_commands.pages())
    assert not wrong, "\n".join(wrong)


def test_the_cli_synopsis_lists_every_command_and_option() -> None:
    """README's "The CLI" block: every command, each with all its options (bench's
    subcommands say `[...]`: their options are in their --help)."""
    tree = cli_tree()
    listed: dict[tuple[str, ...], set[str]] = {}
    for mention in doc_commands.cli_mentions(Path("README.md")):
        listed.setdefault(mention.command, set()).update(mention.flags)
    missing = []
    for name, command in tree.commands.items():
        if hasattr(command, "commands"):
            missing += [f"{name} {sub}" for sub in command.commands if (name, sub) not in listed]
            continue
        spelled = flags_of(command)
        given = {spelled[f] for f in listed.get((name,), set()) if f in spelled}
        options = {p.name for p in command.params if p.param_type_name == "option"}
        for option in sorted(options - given - {"verbose", "config", "help"}):
            missing.append(f"{name} {option}")
    assert not missing, "the README's CLI block leaves out: " + ", ".join(missing)


def test_the_flag_check_finds_an_unknown_command_and_flag(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        "Run `hf3fsctl stats --json` or `hf3fsctl --config F evict --stale -y`.\n\n"
        "```bash\nhf3fsctl doctor --checksums \\\n  --all-pages --bogus   # --also-bogus\n"
        "hf3fsctl statz\n```\n",
    )
    assert wrong_cli_mentions([page], tmp_path) == [
        "page.md:4: hf3fsctl doctor: no option --bogus",
        "page.md:6: hf3fsctl statz: no such command",
    ]


# --- links and the docs index ------------------------------------------------------------


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """Relative links of `pages` to a file that does not exist, or to a heading (or
    `<a id>`) a Markdown file does not have."""
    broken = []
    for page in pages:
        for link in doc_commands.links(page, root):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link.target):
                continue  # a URL
            target, _, fragment = link.target.partition("#")
            path = (root / page).parent.joinpath(target) if target else root / page
            if not path.exists():
                broken.append(f"{link.page}:{link.line}: {link.target} (no such file)")
            elif (
                fragment
                and path.suffix == ".md"
                and fragment
                not in doc_commands.anchors(path.resolve().relative_to(root.resolve()), root)
            ):
                broken.append(f"{link.page}:{link.line}: {link.target} (no such heading)")
    return broken


def test_relative_links_name_files_and_headings_of_the_repository() -> None:
    broken = broken_links(doc_commands.pages())
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        '# Quick start\n\n## `hf3fsctl warm`, again\n\n<a id="decision-5"></a>\n'
        "[a](#quick-start) [b](#hf3fsctl-warm-again) [c](page.md#decision-5) "
        "[d](https://example.com/x.md) [e](gone.md) [f](#nowhere)\n",
    )
    assert broken_links([page], tmp_path) == [
        "page.md:6: gone.md (no such file)",
        "page.md:6: #nowhere (no such heading)",
    ]


def test_the_docs_index_lists_every_docs_page() -> None:
    index = Path("docs/README.md")
    listed = {link.target.split("#", 1)[0] for link in doc_commands.links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    assert pages - listed == set()
