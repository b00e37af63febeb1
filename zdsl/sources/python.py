"""``data python("file.py:batches", k=v...)``: where the function is, found without running anything.

Torch-free: the checker resolves the name as the runtime will load it
(zdsl/runtime/data/python.py), so a missing file, module or function is a
positioned error at ``zdsl check`` time. A ``file.py`` path is relative to the
schedule's folder (as ``model "file.py:build"`` is); ``pkg.module`` is found on
``sys.path`` without importing it (its parent packages' ``__init__`` do not run).
Whether the function is defined is read from the file's syntax tree: a top-level
``def``, assignment or import of that name (a module with ``__getattr__`` or a
``*`` import is given the benefit of the doubt; the runtime's load says the rest).

The function's tensors are its own business (:attr:`PythonSource.token_ids` is false): no context
or vocab is checked here, and a built model is sized from one row of what it returns.
"""
from __future__ import annotations

import ast
import importlib.machinery
from pathlib import Path

from zdsl.schedule import DataSpec
from zdsl.sources.base import DataSource, SourceCall

# The arguments zdsl passes to the function itself; the schedule's key=value settings come on top.
CALL_ARGS = ("seed", "step", "micro", "rank", "world", "batch")
EXAMPLE = 'python("data.py:batches")'


class PythonDataError(ValueError):
    """A data function that cannot be found, called, or broke its contract; the message names it,
    ``hint`` (when set) says what to write instead."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def resolve(target: str, schedule_file: str) -> str:
    """``"file.py:batches"`` (made absolute, from the schedule's folder) or ``"pkg.module:batches"``,
    checked to exist and define the function; raises :class:`PythonDataError`."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise PythonDataError(f'data python("{target}"): expected "file.py:function" or '
                                f'"package.module:function"', hint=EXAMPLE)
    path: Path | None
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser()
        if not path.is_absolute() and not schedule_file.startswith("<"):
            path = Path(schedule_file).parent / path
        if not _is_file(path):
            raise PythonDataError(f"data file not found: {path}",
                                    hint="a data file's path is relative to the schedule file")
        path = path.resolve()
        resolved = f"{path}:{name}"
    else:
        if not all(part.isidentifier() for part in where.split(".")):
            raise PythonDataError(f"{where!r} is neither a .py file nor a module name", hint=EXAMPLE)
        found = module_file(where)
        if found is False:
            raise PythonDataError(f"no module named {where!r} on the Python path",
                                    hint="install it, or name a file: python(\"file.py:function\")")
        path = found if isinstance(found, Path) else None
        resolved = target
    if path is not None and not defines(path, name):
        raise PythonDataError(f"{path} defines no function {name!r}",
                                hint=f"def {name}({', '.join(CALL_ARGS)}): return inputs, targets")
    return resolved


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def module_file(dotted: str) -> Path | None | bool:
    """The source file of module ``dotted`` (None: found, but not as Python source; False: not found),
    looked up package by package with the path finder, executing nothing."""
    parts = dotted.split(".")
    search, spec = None, None
    for i in range(len(parts)):
        if i and search is None:        # a module's attribute made a module (os.path): importing says
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), search)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return False
        search = spec.submodule_search_locations
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its top level (see the module's rule)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return True                     # unreadable here: the runtime's import names the problem
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in (name, "__getattr__"):
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name.split(".")[0]) == name:
                    return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        elif isinstance(node, (ast.If, ast.Try, ast.With)) and _binds_inside(node, name):
            return True                 # a def under `if`, an import in try/except
    return False


def _binds_inside(node, name: str) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.name == name:
            return True
        if isinstance(sub, ast.Name) and sub.id == name and isinstance(sub.ctx, ast.Store):
            return True
        if isinstance(sub, ast.alias) and (sub.asname or sub.name.split(".")[0]) == name:
            return True
    return False


class PythonSource(DataSource):
    kind = "python"
    settings = ()                      # any key=value: passed to the function as keyword arguments
    example = 'python("data.py:batches", features=16)'
    argument = "function"
    token_ids = False

    def check(self, at: SourceCall) -> DataSpec | None:
        """The function (found as :func:`resolve` says) and the settings it is called with."""
        call, report = at.call, at.report
        positional = at.positional()
        if not positional:
            report.error(call.span, "python needs the function that makes batches", hint=self.example)
            return None
        for extra in positional[1:]:
            report.error(extra.span, "python takes key=value settings after the function", hint=self.example)
        args = report.free_settings(call.args, at.span, reserved=CALL_ARGS,
                                    why="zdsl passes {name} to the function itself",
                                    fix=f"remove {{name}}=; the function is called with "
                                        f"{', '.join(CALL_ARGS)} and the settings written here")
        where = positional[0].value
        target = report.string(where, "the data function")
        if target is None:
            return None
        try:
            source = resolve(target, where.span.file)
        except PythonDataError as exc:
            report.error(where.span, str(exc), hint=exc.hint)
            return None
        return DataSpec("python", source, args)


SOURCE = PythonSource()
