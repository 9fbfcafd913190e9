"""The import contract of docs/architecture.md ("Layers"), read from the sources with ast.

Every import statement counts, relative or absolute, at module level or inside a function (a
lazy import runs too), except those under ``if TYPE_CHECKING:`` (never run).  ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``).  The
import of a module's parent packages is not followed: ``tangram_hpc/__init__.py`` is the public
facade and imports the client and the launcher, so following it would make every module import
everything.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tangram_hpc"

#: Layers, lowest first; a module may import its own layer and those below, never one above.
#: The three sides (client, worker, coordinator) are peers: none imports another.
CORE = {"actions", "resources", "protocol", "errors", "config", "config_cli", "connection", "envfiles",
        "netaddr", "security", "runlog", "metrics", "progress", "daemon"}
POLICY = {"policy"}
SIDES = {
    "client": {"client", "client_session", "commands", "integrations"},
    "worker": {"worker", "worker_config", "worker_session", "worker_exec", "worker_frames", "worker_sandboxes", "handlers",
               "managers"},
    "coordinator": {"coordinator", "backends", "slurm"},
}
TOOLS = {"launch", "cli", "__main__", "bench", "bench_family", "sim", "report", "demo", "fidelity", "top", "native", "serve",
         ""}      # "": the package's __init__, the public facade
_THREAD_NAMES = {"get_ident", "local"}
#: The socket-free core: the coordinator's bookkeeping, the policies, the simulator's engine.
SOCKET_FREE = ("tangram_hpc.coordinator.ledger", "tangram_hpc.coordinator.registry",
               "tangram_hpc.coordinator.environments", "tangram_hpc.coordinator.pool_driver",
               "tangram_hpc.coordinator.outbox", "tangram_hpc.coordinator.metrics",
               "tangram_hpc.coordinator.lifecycle", "tangram_hpc.coordinator.answers",
               "tangram_hpc.coordinator.membership",
               "tangram_hpc.sim.engine", "tangram_hpc.sim.baselines", "tangram_hpc.sim.calendar",
               "tangram_hpc.sim.layout", "tangram_hpc.sim.machines", "tangram_hpc.sim.result")
#: Sockets, clocks, processes, threads (and what wraps them).  Not datetime: the launch throttle
#: formats times it is given with it (backends/guards.py, local_time) and reads no clock.  Naming
#: the current thread is not running one: ``from threading import get_ident`` (or ``local``) is
#: read as its own name (protocol.py keys its packers by thread).
IO_MODULES = {"socket", "ssl", "selectors", "asyncio", "zmq", "time", "threading", "_thread",
              "subprocess", "multiprocessing", "concurrent", "signal", "http", "urllib", "requests", "aiohttp"}


def _modules() -> dict[str, Path]:
    found = {}
    for p in PACKAGE.rglob("*.py"):
        if "_native_builds" in p.parts:
            continue
        parts = ("tangram_hpc", *p.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip |= {id(n) for n in ast.walk(child)}
    return skip


@cache
def imports(module: str) -> frozenset[str]:
    """What ``module`` imports: full names, package modules resolved (relative ones included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "threading" and {a.name for a in node.names} <= _THREAD_NAMES:
                out |= {f"threading:{a.name}" for a in node.names}
                continue
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod)
    return frozenset(out)


def closure(module: str) -> dict[str, list[str]]:
    """Every module ``module`` imports, transitively: name -> the chain of imports that reaches it."""
    seen = {module: [module]}
    todo = [module]
    while todo:
        m = todo.pop()
        for dep in imports(m):
            if dep in seen:
                continue
            seen[dep] = seen[m] + [dep]
            if dep in MODULES:
                todo.append(dep)
    return seen


def layer(module: str) -> tuple[int, str]:
    """(rank, name) of a package module's layer."""
    first = module.split(".")[1] if "." in module else ""
    if first in CORE:
        return 0, "core"
    if first in POLICY:
        return 1, "policy"
    for side, members in SIDES.items():
        if first in members:
            return 2, side
    if first in TOOLS:
        return 3, "tools"
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py and docs/architecture.md")


def test_the_import_reader_follows_relative_and_transitive_imports():
    """The reader itself: a relative import resolves, a TYPE_CHECKING one is skipped, a chain is followed."""
    assert "tangram_hpc.policy.base" in imports("tangram_hpc.policy.placement")          # from .base import
    assert "tangram_hpc.protocol" in imports("tangram_hpc.coordinator.ledger")           # from .. import protocol
    assert "tangram_hpc.config" not in imports("tangram_hpc.coordinator.ledger")         # TYPE_CHECKING only
    chain = closure("tangram_hpc.coordinator.server")
    assert chain["zmq"][0] == "tangram_hpc.coordinator.server"
    assert "time" in closure("tangram_hpc.config")          # through connection, two steps away


def test_every_module_is_in_a_layer():
    for m in MODULES:
        layer(m)


@pytest.mark.parametrize("module", SOCKET_FREE + tuple(m for m in sorted(MODULES) if m.startswith("tangram_hpc.policy")))
def test_the_socket_free_core_imports_no_socket_clock_process_or_thread(module):
    chains = closure(module)
    bad = {m: chain for m, chain in chains.items() if m.split(".")[0] in IO_MODULES}
    assert not bad, "\n".join(" -> ".join(c) for c in bad.values())


def test_config_imports_no_policy_manager_or_backend():
    chains = closure("tangram_hpc.config")
    bad = [c for m, c in chains.items()
           if m.startswith(("tangram_hpc.policy", "tangram_hpc.managers", "tangram_hpc.backends"))]
    assert not bad, "\n".join(" -> ".join(c) for c in bad)


def test_no_module_imports_a_layer_above_it_or_a_peer_side():
    bad = []
    for m in sorted(MODULES):
        rank, name = layer(m)
        for dep in imports(m):
            if dep not in MODULES or dep == "tangram_hpc":
                continue
            dep_rank, dep_name = layer(dep)
            if dep_rank > rank or (dep_rank == rank == 2 and dep_name != name):
                bad.append(f"{m} ({name}) imports {dep} ({dep_name})")
    assert not bad, "\n".join(bad)


def test_the_coordinator_never_imports_the_sandbox_manager_or_a_concrete_policy():
    for m in MODULES:
        if m.startswith(("tangram_hpc.coordinator", "tangram_hpc.backends")):
            assert not [d for d in closure(m) if d.startswith("tangram_hpc.managers")], m
            assert not {"tangram_hpc.policy.elastic", "tangram_hpc.policy.fifo", "tangram_hpc.policy.pool",
                        "tangram_hpc.policy.placement"} & set(closure(m)), m


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_PICTURE_LAYERS = {"core": CORE, "policy": POLICY, "client side": SIDES["client"], "worker side": SIDES["worker"],
                   "coordinator": SIDES["coordinator"], "tools": TOOLS}


def _picture() -> dict[str, set[str]]:
    """The folders-to-layers picture of docs/architecture.md ("Layers"): layer -> the names on its rows."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("```\ntangram_hpc/\n") + 4:]
    block = block[:block.index("```")]
    rows: dict[str, set[str]] = {}
    current = ""
    for line in block.splitlines()[1:]:
        label, _, names = line.partition("|")
        current = label.strip() or current
        rows.setdefault(current, set()).update(n.rstrip("/") for n in names.split())
    return rows


def test_the_docs_picture_puts_every_top_level_module_and_folder_in_its_layer():
    picture = _picture()
    assert set(picture) == set(_PICTURE_LAYERS)
    names = [n for row in picture.values() for n in row]
    assert len(names) == len(set(names)), "a name in two layers of the picture"
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert set(names) == top, f"missing from the picture: {sorted(top - set(names))}; not in the package: " \
                              f"{sorted(set(names) - top)}"
    for label, members in _PICTURE_LAYERS.items():
        assert picture[label] == (members - {""}) | ({"__init__"} if "" in members else set()), label


#: Classes over this many lines and modules over that many need a row in docs/architecture.md's
#: table "Sizes over the limits, and why" naming them, with the reason.
CLASS_LINES, MODULE_LINES = 500, 800


def _size_excuses() -> dict[str, str]:
    """What the table of "Sizes over the limits, and why" names (its first cell), and the reason given."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Sizes over the limits, and why"):]
    section = section[:section.index("What moved out")]
    rows = [line.strip().strip("|").split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip(): cells[-1].strip() for cells in rows if len(cells) == 3}


def test_every_class_and_module_over_the_size_limits_is_explained_in_the_docs():
    excuses = _size_excuses()
    unexplained = []
    for module, path in sorted(MODULES.items()):
        src = path.read_text()
        rel = path.relative_to(PACKAGE).as_posix()
        if src.count("\n") > MODULE_LINES and not excuses.get(f"`{rel}`"):
            unexplained.append(f"{rel}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                if not excuses.get(f"`{rel}`, `{node.name}`"):
                    unexplained.append(f"{rel}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not unexplained, "say why in docs/architecture.md, or split: " + "; ".join(unexplained)
