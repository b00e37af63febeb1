"""No import cycles in zdsl/ and runtime/, the compiler's packages import one way (``LAYERS``), and
the compiler never imports the runtime.

The modules are read with ``ast``, never imported, so the test sees every import
statement: at module level and inside functions (a lazy import that closes a cycle
still ties the two modules into one, and only fails on the path that runs it).

An edge ``a -> b`` is an import of module ``b`` in ``a``: ``import b``, ``from b import
name``, or ``from pkg import b`` where ``b`` is a submodule of ``pkg``. A name taken
from a package (``from zdsl.runtime.checkpoint import CheckpointError``) is an edge to
the package's ``__init__``, so a module that imports its own package's re-exports while
that ``__init__`` imports it is a cycle. The parent packages Python initialises on the
way to a submodule are not edges: a package whose ``__init__`` re-exports its
submodules would otherwise always be one.

The compiler reaches the runtime by name, at run time: ``zdsl/cli.py``'s ``DELEGATED``
commands (``importlib``) and subprocesses (``python -m zdsl.runtime...``); by an import
statement only where listed in ``DELEGATIONS``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"zdsl": ROOT / "zdsl", "zdsl.runtime": ROOT / "runtime"}   # as pyproject's package-dir maps them

# The compiler's imports of the runtime, each lazy and the reason it cannot be otherwise.
DELEGATIONS = {
    # a user's own torch model is sized by building it on the meta device, which needs torch;
    # check and plan of the built-in GPT never get there (tests/compiler/test_no_torch.py)
    ("zdsl.compile.models", "zdsl.runtime.sizing"),
    # zdsl.initialize and zdsl.units are the Python API's entry points, a user's first import;
    # they bring in the runtime (torch) only when called, so `import zdsl` stays torch-free
    ("zdsl", "zdsl.runtime.api"),
}


# The compiler's packages, lowest first (ARCHITECTURE.md draws them): a module imports its own
# layer and those below, never one above; top-level modules not listed are the foundation.
LAYERS = (
    ("zdsl.lang",),                    # text to AST: parse, overrides, sizes, errors
    ("zdsl.model",),                   # the model as units, without torch: sizes, layout, freeze, decay
    ("zdsl.sim",),                     # the cost model: a graph's step simulated on a machine profile
    ("zdsl.check", "zdsl.sources"),    # AST to Schedule; a data source's settings and checks
    ("zdsl.compile",),                 # Schedule to a verified TaskGraph
    ("zdsl.driver",),                  # the pipeline every command calls
    ("zdsl.planner", "zdsl.observe"),  # what `zdsl plan` says; traces and timelines
    ("zdsl.tune",),                    # measured choices between schedules
    ("zdsl.cli", "zdsl"),              # the commands; the package's entry points
)

# The runtime's packages, lowest first, likewise (a module of runtime/ itself is its own layer).
RUNTIME_LAYERS = (
    ("zdsl.runtime.io",),              # aligned buffers, direct I/O, checksums, host access stamps
    ("zdsl.runtime.proc",),            # a rank's process: guard, progress board, fault injection
    ("zdsl.runtime.dist",),            # process groups, collectives, the local rank spawner
    ("zdsl.runtime.models",),          # the unit protocol, the built-in GPT, Hugging Face models
    ("zdsl.runtime.data",),            # batches from each source kind
    ("zdsl.runtime.sizing",),          # a model sized on the meta device with a row of its data
    ("zdsl.runtime.offload",),         # the NVMe swapper, the host AdamW
    ("zdsl.runtime.state",),           # a rank's buffers and what each op does to them
    ("zdsl.runtime.exec",),            # lanes as trio tasks, the happens-before checker
    ("zdsl.runtime.checkpoint",),      # sharded checkpoints and export
    ("zdsl.runtime.run",),             # zdsl run: launch, pre-flight, the training loop
    ("zdsl.runtime.calibrate",),       # microbenchmarks that write a machine statement
    ("zdsl.runtime.api",),             # a user's own loop under a schedule
)


def runtime_layer_of(module: str) -> int | None:
    """The index in RUNTIME_LAYERS of a runtime module's package; None outside the runtime and for
    the runtime package's own ``__init__``."""
    for i, (package,) in enumerate(RUNTIME_LAYERS):
        if module == package or module.startswith(package + "."):
            return i
    return None


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a compiler module's package (0 before them: the foundation, i.e.
    zdsl.ir, zdsl.schedule, zdsl.env ...); None for the runtime."""
    if module == "zdsl.runtime" or module.startswith("zdsl.runtime."):
        return None
    for i, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages if p != "zdsl") or module in packages:
            return i + 1
    return 0

def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of zdsl/ and runtime/."""
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules ``module`` imports anywhere in ``tree``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                          # relative: from the module's own package up
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # a submodule taken from a package is that module; a name is its package (or module)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:       # `import a.b.c` of a name inside a module: that module
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported(ast.parse(path.read_text(encoding="utf-8"), str(path)), name,
                           path.name == "__init__.py", known)
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) through each strongly connected group of
    modules (Tarjan), each group reported once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:                   # recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [cycle_in(graph, group) for group in groups]


def cycle_in(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest cycle through the group's first module, by breadth-first search inside the group."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {group}")


def test_the_walk_sees_every_package_and_lazy_imports():
    graph = import_graph()
    assert "zdsl.cli" in graph and "zdsl.runtime.run.train" in graph and "zdsl.runtime.checkpoint" in graph
    assert "zdsl.sim.simulate" in graph["zdsl.planner.machine_fit"]     # imported inside schedule_fit


def test_no_module_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_the_compiler_never_imports_the_runtime():
    graph = import_graph()
    found = {(m, t) for m, targets in graph.items() if not m.startswith("zdsl.runtime")
             for t in targets if t == "zdsl.runtime" or t.startswith("zdsl.runtime.")}
    bad = sorted(f"{m} -> {t}" for m, t in found - DELEGATIONS)
    assert not bad, "the compiler imports the runtime (name it at run time, or list it in DELEGATIONS " \
        "with the reason):\n  " + "\n  ".join(bad)
    assert DELEGATIONS <= found, f"DELEGATIONS lists imports that are gone: {sorted(DELEGATIONS - found)}"


def test_the_compiler_imports_downward_only():
    graph = import_graph()
    up = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m))
    assert not up, "imports against LAYERS (move the shared piece down, or the importer up):\n  " + "\n  ".join(up)


def test_the_runtime_imports_downward_only():
    graph = import_graph()
    up = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if runtime_layer_of(m) is not None and runtime_layer_of(t) is not None
                and runtime_layer_of(t) > runtime_layer_of(m))
    assert not up, "imports against RUNTIME_LAYERS (move the shared piece down, or the importer up):\n  " + \
        "\n  ".join(up)


def test_runtime_layers_name_every_runtime_package():
    modules = [m for m in import_graph() if m.startswith("zdsl.runtime.")]
    unplaced = sorted(m for m in modules if runtime_layer_of(m) is None)
    assert not unplaced, f"runtime modules in no layer: {unplaced}"


def test_layers_name_every_compiler_package():
    packages = {m.split(".")[1] for m in import_graph() if m.count(".") >= 2 and layer_of(m) is not None}
    listed = {p.split(".")[1] for layer in LAYERS for p in layer if p != "zdsl"}
    assert packages <= listed, f"packages of zdsl/ in no layer: {sorted(packages - listed)}"
    assert layer_of("zdsl.ir") == 0 and layer_of("zdsl.cli") == len(LAYERS) and layer_of("zdsl.sim.simulate") == 3


def test_a_cycle_is_found_and_printed():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_how_an_import_statement_becomes_an_edge():
    known = {"zdsl.runtime.checkpoint", "zdsl.runtime.checkpoint.reader", "zdsl.runtime.checkpoint.index",
             "zdsl", "zdsl.env", "zdsl.ir"}
    edges = lambda code, module="zdsl.runtime.checkpoint.reader", package=False: imported(  # noqa: E731
        ast.parse(code), module, package, known)
    assert edges("from zdsl.runtime.checkpoint import CheckpointError") == {"zdsl.runtime.checkpoint"}
    assert edges("from zdsl.runtime.checkpoint import index") == {"zdsl.runtime.checkpoint.index"}
    assert edges("def f():\n    import zdsl.ir as ir\n") == {"zdsl.ir"}
    assert edges("from zdsl import env, ir") == {"zdsl.env", "zdsl.ir"}
    assert edges("from .index import Index") == {"zdsl.runtime.checkpoint.index"}
    assert edges("from . import index", "zdsl.runtime.checkpoint", True) == {"zdsl.runtime.checkpoint.index"}
    assert edges("import json\nfrom zdsl.runtime.checkpoint.reader import x") == set()   # outside, itself
