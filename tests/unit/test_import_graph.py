"""The module graph of `hf3fsctl/` and `connector/` (`hf3fsctl_connector`): no cycle, and
every import within the layer rules (which rooms may import which: `MAY_IMPORT`).

Every import counts: top-level, inside functions, and under `if TYPE_CHECKING:` (a
cycle there is still two modules that each need the other to be understood). The files
are parsed, not imported, so nothing here needs vLLM or torch.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"hf3fsctl": REPO / "hf3fsctl", "hf3fsctl_connector": REPO / "connector"}

# Imports that close a cycle and are known (none: keep it so). An entry here is an
# import the test forgives; `test_allowed_cycle_edges_still_exist` asks for stale ones
# to go.
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


@cache
def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found[".".join(parts)] = Module(".".join(parts), path, is_package)
    return found


def _imported_names(module: Module) -> Iterator[str]:
    """Absolute dotted names of everything `module` imports, anywhere in the file."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base


def _owner(name: str) -> str | None:
    """The module of ours that importing `name` loads (None: not ours)."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@cache
def graph() -> dict[str, frozenset[str]]:
    edges = {}
    for name, module in modules().items():
        targets = {_owner(imported) for imported in _imported_names(module)}
        edges[name] = frozenset(t for t in targets if t is not None and t != name)
    return edges


def _cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _path(edges: dict[str, frozenset[str]], start: str, goal: str) -> list[str]:
    """One import chain from `start` to `goal` (for the failure message)."""
    seen, frontier = {start: [start]}, [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(edges[node]):
            if child not in seen:
                seen[child] = [*seen[node], child]
                if child == goal:
                    return seen[child]
                frontier.append(child)
    return []


def test_the_graph_covers_both_packages() -> None:
    names = set(modules())
    assert {"hf3fsctl.tier", "hf3fsctl.storage.engine", "hf3fsctl_connector.worker"} <= names
    assert "hf3fsctl.storage.layout" in graph()["hf3fsctl.tier"]
    assert "hf3fsctl_connector.jobs" in graph()["hf3fsctl_connector.worker"]


def test_no_import_cycle() -> None:
    edges = {
        name: frozenset(t for t in targets if (name, t) not in ALLOWED_CYCLE_EDGES)
        for name, targets in graph().items()
    }
    cycles = [
        " -> ".join([*_path(edges, c[0], c[1]), *_path(edges, c[1], c[0])[1:]])
        for c in _cycles(edges)
    ]
    assert cycles == []


def test_allowed_cycle_edges_still_exist() -> None:
    """An exemption whose import is gone must be dropped from `ALLOWED_CYCLE_EDGES`."""
    edges = graph()
    stale = sorted((a, b) for a, b in ALLOWED_CYCLE_EDGES if b not in edges.get(a, frozenset()))
    assert stale == []


def test_the_cycle_detector_finds_a_cycle() -> None:
    edges = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a"}),
        "d": frozenset({"a"}),
    }
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_the_tier_reaches_neither_the_cli_nor_the_connector() -> None:
    edges = graph()
    reached, frontier = {"hf3fsctl.tier"}, ["hf3fsctl.tier"]
    while frontier:
        for child in edges[frontier.pop()]:
            if child not in reached:
                reached.add(child)
                frontier.append(child)
    assert sorted(m for m in reached if m.startswith(("hf3fsctl_connector", "hf3fsctl.cli"))) == []


def test_importing_the_tier_loads_no_vllm_and_no_torch() -> None:
    probe = (
        "import sys, hf3fsctl.tier; "
        "print(sorted(m for m in ('torch', 'vllm', 'fastapi', 'hf3fsctl_connector') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.strip() == "[]"


def test_the_connector_worker_side_imports_with_vllm_blocked() -> None:
    # A GPU node runs the worker side (and tests/gpu drives it) without vLLM: any vLLM
    # import at module level of the worker or what it imports fails this subprocess.
    probe = (
        "import sys\n"
        "class BlockVllm:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is blocked: ' + name)\n"
        "sys.meta_path.insert(0, BlockVllm())\n"
        "import hf3fsctl_connector.worker, hf3fsctl_connector.metadata\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# The core library: what runs without vLLM and without the CLI (docs/design.md, "Rules of
# the shape"). Each name is a module or a package with everything under it.
CORE = (
    "hf3fsctl.config",
    "hf3fsctl.keys",
    "hf3fsctl.errors",
    "hf3fsctl.storage",
    "hf3fsctl.meta",
    "hf3fsctl.staging",
    "hf3fsctl.tier",
    "hf3fsctl.health",
    "hf3fsctl.prompt_keys",
    "hf3fsctl.ops",
)
# What the core must do without: importing any of these fails in the probe below.
OUTSIDE_THE_CORE = ("vllm", "hf3fsctl.cli", "hf3fsctl.vllm_tools", "hf3fsctl_connector")
# A module of the CLI: imported among the core ones, it must be the one that fails (the
# proof that the probe blocks what it says).
CONTROL = "hf3fsctl.cli.main"

IMPORT_EACH_BLOCKED = """
import importlib, json, sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
failed = {{}}
for name in {names!r}:
    # One interpreter, the finder in place from the start: any module importing a
    # blocked one at import time fails (a failed import is not cached, so a module
    # first reached through another is tried again here and fails under its own name).
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(failed))
"""


def core_modules() -> list[str]:
    return sorted(
        name
        for name in modules()
        if name == "hf3fsctl" or any(name == c or name.startswith(c + ".") for c in CORE)
    )


def test_every_core_module_imports_without_vllm_or_the_cli() -> None:
    names = [*core_modules(), CONTROL]
    probe = IMPORT_EACH_BLOCKED.format(blocked=OUTSIDE_THE_CORE, names=names)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True
    )
    failed = json.loads(done.stdout)
    assert sorted(failed) == [CONTROL], failed
    assert failed[CONTROL].startswith("ImportError: blocked: hf3fsctl.cli")
    assert {"hf3fsctl.staging", "hf3fsctl.ops.build", "hf3fsctl.meta.sqlite.store"} <= set(names)


def test_the_core_reaches_none_of_vllm_tools_the_cli_or_the_connector() -> None:
    """Every import counts, in functions too: the core never needs what lies outside it."""
    edges = graph()
    outside = ("hf3fsctl.vllm_tools", "hf3fsctl.cli", "hf3fsctl_connector")
    found = []
    for start in core_modules():
        reached, frontier = {start}, [start]
        while frontier:
            for child in edges[frontier.pop()]:
                if child not in reached:
                    reached.add(child)
                    frontier.append(child)
        found += [
            " -> ".join(_path(edges, start, m)) for m in sorted(reached) if m.startswith(outside)
        ]
    assert found == []


def test_no_core_module_imports_vllm_even_inside_a_function() -> None:
    found = sorted(
        f"{name} imports {imported}"
        for name in core_modules()
        for imported in _imported_names(modules()[name])
        if imported == "vllm" or imported.startswith("vllm.")
    )
    assert found == []


# --- layer rules ------------------------------------------------------------------------
# Rooms: a module is in the room of the longest prefix here that names it (a module or a
# package with everything under it). A new top-level module of `hf3fsctl` falls into
# `core` (the strictest outer rules) until it is given a room of its own.
ROOMS: dict[str, str] = {
    "hf3fsctl": "core",  # the package (`__version__`) and core modules not named below
    "hf3fsctl.errors": "errors",
    "hf3fsctl.config": "config",
    "hf3fsctl.keys": "keys",
    "hf3fsctl.prompt_keys": "keys",
    "hf3fsctl.storage": "storage",
    "hf3fsctl.meta": "meta",
    "hf3fsctl.ops": "ops",
    "hf3fsctl.staging": "staging",
    "hf3fsctl.tier": "tier",
    "hf3fsctl.health": "health",
    "hf3fsctl.bench": "bench",
    "hf3fsctl.offline": "offline",
    "hf3fsctl.vllm_tools": "vllm_tools",
    "hf3fsctl.cli": "cli",
    "hf3fsctl.__main__": "cli",
    "hf3fsctl_connector": "connector",
}
# The core library (docs/design.md, "Rules of the shape"): it runs without vLLM, the CLI,
# the benchmarks, the offline tools and the connector.
CORE_ROOMS = frozenset(
    {"core", "errors", "config", "keys", "storage", "meta", "ops", "staging", "tier", "health"}
)
ALL_ROOMS = frozenset(ROOMS.values())
# Which rooms each room may import (its own always). Every import counts, in functions too.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "errors": frozenset(),  # the vocabulary every room speaks
    "config": frozenset({"errors"}),
    "keys": frozenset({"errors", "config"}),
    # Pages know nothing of the index: the storage room never imports meta (or above it).
    "storage": frozenset({"errors", "config", "keys"}),
    "meta": frozenset({"errors", "config", "keys", "storage"}),
    "ops": frozenset({"errors", "staging", "storage"}),
    "staging": frozenset({"errors", "ops", "storage"}),
    "tier": frozenset({"errors", "config", "keys", "storage", "meta", "staging"}),
    "health": CORE_ROOMS,
    "core": CORE_ROOMS,
    # The connector is a consumer of the core and of the vLLM-facing tools (numerics:
    # what an engine's VllmConfig says about its KV's bits), never of the CLI, benchmarks
    # or offline tools.
    "connector": CORE_ROOMS | {"vllm_tools"},
    "vllm_tools": CORE_ROOMS | {"connector"},
    "offline": CORE_ROOMS | {"connector", "vllm_tools"},
    # Benchmarks measure the core (and run engines through vllm_tools); rendering their
    # documents is the CLI's, so bench imports no cli.
    "bench": CORE_ROOMS | {"vllm_tools"},
    "cli": ALL_ROOMS,
}
# Rooms inside `hf3fsctl.meta` and which of them each may import: the metadata package's
# own rules, kept by its owner (docs/design.md, the metadata section). A key is a module or
# package under `hf3fsctl.meta` (e.g. "hf3fsctl.meta.sqlite"), its value the other keys it
# may import, and "hf3fsctl.meta" for the modules in no key (those are unconstrained).
# Inside meta/ (docs/design.md "Metadata"): the vocabulary (models, protocol, policy,
# giveback) imports no store, client or server; the one store core (base) no backend;
# the backends (sqlite/, redis/) never each other, http/, server/ or the client factory;
# http/ only the vocabulary; server/ reaches stores only through protocol + the factory.
# `client` (the factory, the one place that may import every backend) and the package
# itself are the catch-all room.
META_MAY_IMPORT: dict[str, frozenset[str]] = {
    "hf3fsctl.meta.models": frozenset(),
    "hf3fsctl.meta.protocol": frozenset({"hf3fsctl.meta.models"}),
    "hf3fsctl.meta.policy": frozenset(),
    "hf3fsctl.meta.giveback": frozenset(),
    "hf3fsctl.meta.base": frozenset(
        {
            "hf3fsctl.meta.protocol",
            "hf3fsctl.meta.models",
            "hf3fsctl.meta.policy",
            "hf3fsctl.meta.giveback",
        }
    ),
    "hf3fsctl.meta.sqlite": frozenset(
        {
            "hf3fsctl.meta.base",
            "hf3fsctl.meta.giveback",
            "hf3fsctl.meta.models",
            "hf3fsctl.meta.policy",
            "hf3fsctl.meta.protocol",
        }
    ),
    "hf3fsctl.meta.redis": frozenset(
        {
            "hf3fsctl.meta.base",
            "hf3fsctl.meta.giveback",
            "hf3fsctl.meta.models",
            "hf3fsctl.meta.policy",
            "hf3fsctl.meta.protocol",
        }
    ),
    "hf3fsctl.meta.http": frozenset({"hf3fsctl.meta.models", "hf3fsctl.meta.protocol"}),
    "hf3fsctl.meta.server": frozenset(
        {
            "hf3fsctl.meta.protocol",
            "hf3fsctl.meta.models",
            "hf3fsctl.meta.policy",
            "hf3fsctl.meta",  # the client factory (run.py opens the store)
        }
    ),
}


def room_of(name: str, rooms: dict[str, str] = ROOMS) -> str:
    """The room of module `name`: that of the longest prefix in `rooms` naming it."""
    best = ""
    for prefix in rooms:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return rooms[best]


def layer_violations(
    edges: dict[str, frozenset[str]],
    rooms: dict[str, str],
    may_import: dict[str, frozenset[str]],
) -> list[str]:
    """`a imports b (room x may not import room y)` for every import the rules forbid."""
    found = []
    for name, targets in sorted(edges.items()):
        source = room_of(name, rooms)
        for target in sorted(targets):
            room = room_of(target, rooms)
            if room != source and room not in may_import[source]:
                found.append(f"{name} imports {target} ({source} may not import {room})")
    return found


def test_every_room_has_rules() -> None:
    assert set(MAY_IMPORT) == set(ALL_ROOMS)
    assert all(allowed <= ALL_ROOMS for allowed in MAY_IMPORT.values())


def test_every_import_follows_the_layer_rules() -> None:
    assert layer_violations(graph(), ROOMS, MAY_IMPORT) == []


def test_the_layer_checker_finds_a_forbidden_import() -> None:
    rooms = {"lib": "core", "lib.cli": "cli", "lib.bench": "bench"}
    rules = {"core": frozenset(), "bench": frozenset({"core"}), "cli": frozenset({"core", "bench"})}
    edges = {
        "lib.store": frozenset(),
        "lib.bench.run": frozenset({"lib.store", "lib.cli.output"}),
        "lib.cli.main": frozenset({"lib.bench.run", "lib.store"}),
    }
    assert layer_violations(edges, rooms, rules) == [
        "lib.bench.run imports lib.cli.output (bench may not import cli)"
    ]


def test_the_metadata_rooms_name_real_modules() -> None:
    names = [*META_MAY_IMPORT, *(n for v in META_MAY_IMPORT.values() for n in v)]
    unknown = sorted({n for n in names if n not in modules() or room_of(n) != "meta"})
    assert unknown == []


def test_the_metadata_rooms_follow_their_rules() -> None:
    meta = {name: t for name, t in graph().items() if room_of(name) == "meta"}
    rooms = {"hf3fsctl.meta": "hf3fsctl.meta", **{room: room for room in META_MAY_IMPORT}}
    rules = {"hf3fsctl.meta": frozenset(rooms), **META_MAY_IMPORT}
    inside = {n: frozenset(x for x in t if room_of(x) == "meta") for n, t in meta.items()}
    assert layer_violations(inside, rooms, rules) == []
