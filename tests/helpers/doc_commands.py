"""The shell commands and links of the project's Markdown, for tests/docs/test_doc_commands.py.

Pages: README.md, docs/*.md and deploy/**/*.md. Every fenced block whose language is
`bash`, `sh`, `shell` or `console` is a list of commands (in `console` blocks only the
lines after a `$ ` prompt; the others are output). A command is one logical line:
backslash continuations and quoted strings that span lines are joined.

What the Markdown says about a command (docs/README.md, "Commands in the docs"):

- `<!-- not run: REASON -->` on the line before a fence: no command of the block runs.
- `# not run: REASON` as a command's comment (at the end of one of its lines): that
  command does not run.
- `# exits N` in a command's comment: the command is expected to exit with status N
  (0 otherwise), for a doc that shows a failure.
- `<!-- docs test: host NAME -->` before a fence: the block runs on another host of the
  page (its own /etc, /var, ...; the same shared mount and services); `meta-host` is the
  page's first host.

`substitute` turns a command's machine paths, ports and host names into the test's
sandbox (see `Sandbox`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
PAGE_GLOBS = ("README.md", "docs/*.md", "deploy/**/*.md")
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
MAIN_HOST = "main"

_BLOCK_NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->", re.S)
_BLOCK_HOST = re.compile(r"<!--\s*docs test:\s*host\s+(?P<host>[\w-]+)\s*-->")
_NOT_RUN = re.compile(r"(?:^|\s)#.*?\bnot run:\s*(?P<reason>.+?)\s*$")
_EXITS = re.compile(r"(?:^|\s)#.*?\bexits\s+(?P<status>\d+)\b")

# Absolute paths of a real machine that a doc's commands use; each becomes the same path
# under the host's sandbox root. /mnt/3fs is the shared mount: one for all hosts.
MACHINE_PATHS = (
    "/mnt/3fs",
    "/etc/hf3fsctl",
    "/etc/systemd/system",
    "/etc/prometheus",
    "/var/lib/hf3fsctl",
    "/backups",
    "/opt/hf3fsctl",
    "/tmp/hf",
)
SHARED_PATHS = ("/mnt/3fs",)
_PATH = re.compile(
    r"(?<![\w.-])(?P<path>" + "|".join(re.escape(p) for p in MACHINE_PATHS) + r")(?![\w.-])"
)
# Ports and hosts of the docs, and what they become: the page's own services on loopback.
DEFAULT_PORTS = {"18765": "serve", "6379": "redis"}
_PORT = re.compile(r"(?<![\w.])(?P<port>" + "|".join(DEFAULT_PORTS) + r")(?!\d)")
_SCP_FROM = re.compile(r"\bscp\s+meta-host:(?P<path>/\S+)")
# The unit's dedicated user does not exist here: its files belong to the test's user.
USER_SUBSTITUTIONS = (
    ("sudo -u hf3fsctl ", ""),
    ("-o hf3fsctl -g hf3fsctl ", ""),
    ("chgrp hf3fsctl ", 'chgrp "$(id -g)" '),
)


@dataclass(frozen=True)
class Command:
    """One command of a page: where it is, its text, and what the page says about it."""

    page: str
    line: int
    text: str
    host: str = MAIN_HOST
    not_run: str | None = None
    status: int = 0

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Link:
    page: str
    line: int
    target: str


def pages(root: Path = ROOT) -> list[Path]:
    """Every Markdown page whose commands are tested, relative to `root`, in a fixed order."""
    found = {path for pattern in PAGE_GLOBS for path in root.glob(pattern)}
    return sorted(path.relative_to(root) for path in found)


def _logical_lines(body: str, console: bool) -> list[tuple[int, str]]:
    """(offset of the first line, text) of each command of a block's body."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(body.splitlines()):
        line = raw
        if not pending:
            if console:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = offset
        pending.append(line)
        text = "\n".join(pending)
        if text.endswith("\\") or not _quotes_closed(text):
            continue
        commands.append((start, text))
        pending = []
    if pending:
        commands.append((start, "\n".join(pending)))
    return commands


def _quotes_closed(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def commands(page: Path, root: Path = ROOT) -> list[Command]:
    """The commands of one page, in order."""
    tokens = MarkdownIt("commonmark").parse((root / page).read_text())
    found: list[Command] = []
    for index, token in enumerate(tokens):
        language = token.info.strip().split(" ")[0].lower()
        if token.type != "fence" or language not in SHELL_LANGUAGES or token.map is None:
            continue
        block_not_run, host = None, MAIN_HOST
        for previous in reversed(tokens[:index]):
            if previous.type != "html_block" or previous.map is None:
                break
            if (match := _BLOCK_NOT_RUN.search(previous.content)) is not None:
                block_not_run = " ".join(match["reason"].split())
            if (match := _BLOCK_HOST.search(previous.content)) is not None:
                host = match["host"]
        for offset, text in _logical_lines(token.content, language == "console"):
            reason = block_not_run
            status = 0
            for line in text.splitlines():
                if (match := _NOT_RUN.search(line)) is not None:
                    reason = reason or match["reason"]
                if (match := _EXITS.search(line)) is not None:
                    status = int(match["status"])
            found.append(Command(str(page), token.map[0] + 2 + offset, text, host, reason, status))
    return found


def links(page: Path, root: Path = ROOT) -> list[Link]:
    """Every link target of a page (inline and reference links, images included)."""
    found: list[Link] = []
    for token in MarkdownIt("commonmark").parse((root / page).read_text()):
        for child in token.children or ():
            target = child.attrGet("href") if child.type == "link_open" else None
            if child.type == "image":
                target = child.attrGet("src")
            if isinstance(target, str) and token.map is not None:
                lines = token.content.splitlines()
                at = next((i for i, text in enumerate(lines) if target in text), 0)
                found.append(Link(str(page), token.map[0] + 1 + at, target))
    return found


@dataclass(frozen=True)
class CliMention:
    """`hf3fsctl COMMAND --flag…` written somewhere in a page (a code span, a fence line
    or the CLI synopsis): the command's words and the flags given to it."""

    page: str
    line: int
    command: tuple[str, ...]
    flags: tuple[str, ...]


_GLOBAL_WITH_VALUE = frozenset({"--config", "-c"})
_FLAG = re.compile(r"^-{1,2}[a-zA-Z][\w-]*")
_STOP = frozenset({"|", "||", "&&", ";", ")", "\\"})


def _mention(words: list[str], page: str, line: int, synopsis: bool) -> CliMention | None:
    """The command and flags of `words`, which start just after `hf3fsctl` (in a
    synopsis, `|` separates alternatives instead of ending the command)."""
    index = 0
    while index < len(words) and words[index].startswith("-"):
        index += 2 if words[index] in _GLOBAL_WITH_VALUE else 1
    command: list[str] = []
    while index < len(words) and re.fullmatch(r"[a-z][a-z0-9-]*", words[index]):
        command.append(words[index])
        index += 1
        if command != ["bench"]:
            break
    if not command:
        return None
    flags: list[str] = []
    for word in words[index:]:
        if (word in _STOP and not (synopsis and word == "|")) or word.startswith("#"):
            break
        for part in word.strip("[](){}.,;'\"").split("|"):
            if (match := _FLAG.match(part.strip("[]()"))) is not None:
                flags.append(match[0])
    return CliMention(page, line, tuple(command), tuple(flags))


def _mentions_in(text: str, page: str, line: int, synopsis: bool = False) -> list[CliMention]:
    words = text.replace("`", " ").split()
    found = []
    for index, word in enumerate(words):
        if word != "hf3fsctl" and not word.endswith("/hf3fsctl"):
            continue
        mention = _mention(words[index + 1 :], page, line, synopsis)
        # `sudo -u hf3fsctl hf3fsctl init`: the user's name, then the command
        if mention is not None and mention.command != ("hf3fsctl",):
            found.append(mention)
    return found


def cli_mentions(page: Path, root: Path = ROOT) -> list[CliMention]:
    """Every `hf3fsctl COMMAND [flags]` a page writes in code: code spans, fenced lines
    (continuations joined) and the README's synopsis block (`hf3fsctl [--config PATH]
    COMMAND`, then one command per two-space-indented line)."""
    tokens = MarkdownIt("commonmark").parse((root / page).read_text())
    found: list[CliMention] = []
    for token in tokens:
        if token.map is None:
            continue
        if token.type == "inline":
            for child in token.children or ():
                if child.type == "code_inline":
                    at = next(
                        (i for i, t in enumerate(token.content.splitlines()) if child.content in t),
                        0,
                    )
                    found += _mentions_in(child.content, str(page), token.map[0] + 1 + at)
        elif token.type == "fence":
            lines = token.content.splitlines()
            synopsis = bool(lines) and lines[0].startswith("hf3fsctl [--config PATH] COMMAND")
            entry: list[str] = []
            entry_line = token.map[0] + 2
            for offset, text in enumerate([*lines, ""]):
                number = token.map[0] + 2 + offset
                if synopsis:
                    if re.match(r"^  [a-z]", text) or not text.strip():
                        if entry:
                            joined = "hf3fsctl " + " ".join(entry)
                            found += _mentions_in(joined, str(page), entry_line, synopsis=True)
                        entry, entry_line = [text], number
                    else:
                        entry.append(text)
                    continue
                entry.append(re.sub(r"(^|\s)#.*$", "", text).rstrip("\\"))
                if text.endswith("\\"):
                    continue
                found += _mentions_in(" ".join(entry), str(page), number - len(entry) + 1)
                entry = []
    return found


_HTML_ID = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")


def anchors(page: Path, root: Path = ROOT) -> set[str]:
    """The fragments a link may name in `page`: GitHub's heading slugs (lower case,
    punctuation dropped, spaces as hyphens, `-1`, `-2`… for repeats) and `<a id=…>`."""
    tokens = MarkdownIt("commonmark").parse((root / page).read_text())
    found: set[str] = set()
    for index, token in enumerate(tokens):
        if token.type in ("html_block", "inline"):
            found.update(_HTML_ID.findall(token.content))
        if token.type != "heading_open":
            continue
        inline = tokens[index + 1]
        text = "".join(
            c.content for c in inline.children or () if c.type in ("text", "code_inline")
        )
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        unique, repeat = slug, 0
        while unique in found:
            repeat += 1
            unique = f"{slug}-{repeat}"
        found.add(unique)
    return found


@dataclass
class Sandbox:
    """Where a page's commands run: one root directory per host standing in for `/`, the
    page's shared mount, and the loopback ports of the page's services."""

    directory: Path
    ports: dict[str, int]
    roots: dict[str, Path] = field(default_factory=dict)

    def root(self, host: str) -> Path:
        if host not in self.roots:
            root = self.directory / host
            # what every host has: /etc/systemd/system included (a unit is copied there)
            for name in ("etc/systemd/system", "var/lib", "tmp", "home", "opt"):
                (root / name).mkdir(parents=True, exist_ok=True)
            self.roots[host] = root
        return self.roots[host]

    def path(self, host: str, machine_path: str) -> Path:
        shared = any(machine_path.startswith(p) for p in SHARED_PATHS)
        return self.root(MAIN_HOST if shared else host) / machine_path.lstrip("/")

    @property
    def mount(self) -> Path:
        """The shared file system (/mnt/3fs): a mount point that exists on every host."""
        mount = self.path(MAIN_HOST, "/mnt/3fs")
        mount.mkdir(parents=True, exist_ok=True)
        return mount


def substitute(text: str, sandbox: Sandbox, host: str = MAIN_HOST) -> str:
    """`text` with the machine's paths, the service user, ports and hosts of the sandbox."""
    text = _SCP_FROM.sub(lambda m: f"cp {sandbox.path(MAIN_HOST, m['path'])}", text)
    text = _PATH.sub(lambda m: str(sandbox.path(host, m["path"])), text)
    for old, new in USER_SUBSTITUTIONS:
        text = text.replace(old, new)
    text = _PORT.sub(lambda m: str(sandbox.ports[DEFAULT_PORTS[m["port"]]]), text)
    text = re.sub(r"\bmeta-host\b", "127.0.0.1", text)
    return text.replace("0.0.0.0", "127.0.0.1")
