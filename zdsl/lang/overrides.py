"""``--set key=value``: change any train or policy value from the command line.

An override is turned into .zs text (``--set steps=50`` becomes
``train steps=50``, ``--set zero=2`` becomes ``zero 2``), parsed with the
same grammar and spliced into the statements before checking, so its value
is checked exactly like one written in the file, and an error in it points
at the override (file ``--set``, one line per override). An unknown key is a
usage error with the nearest valid key as hint.
"""
from __future__ import annotations

import dataclasses

from zdsl.ir import TIERS
from zdsl.lang import ast
from zdsl.lang.errors import UsageError, ZsError, did_you_mean, error
from zdsl.schedule import GPT_DEFAULTS, MACHINE_OPTIONS, STATES

OVERRIDE_FILE = "--set"

TRAIN_KEYS = ("steps", "batch", "accumulate", "precision", "seed")
OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "clip", "warmup", "decay", "min_lr",
                  "decay_steps", "no_decay")
MACHINE_KEYS = tuple(key for key, _ in MACHINE_OPTIONS)
OFFLOAD_KEYS = ("pinned", "ratio", "block", "depth")
# Statements replaced whole by ``--set KEYWORD=REST`` (the rest of the statement's line).
STATEMENT_KEYS = ("model", "data", "optimizer", "ranks", "zero", "shard", "secondary", "prefetch", "bucket",
                  "overlap", "recompute", "persist", "memory", "machine", "link", "checkpoint", "freeze", "eval")
CALL_STATEMENTS = ("model", "data", "optimizer", "machine")


def known_keys() -> list[str]:
    keys = list(TRAIN_KEYS) + [f"train.{k}" for k in TRAIN_KEYS]
    keys += list(OPTIMIZER_KEYS) + [f"optimizer.{k}" for k in OPTIMIZER_KEYS]
    keys += list(STATEMENT_KEYS) + ["device", "per_node"]
    keys += [f"offload.{s}" for s in STATES]
    keys += [f"offload.{s}.{k}" for s in STATES for k in OFFLOAD_KEYS]
    keys += [f"memory.{t}" for t in TIERS]
    keys += [f"model.{k}" for k in GPT_DEFAULTS]
    keys += ["data.context", "data.vocab"]
    keys += [f"machine.{k}" for k in MACHINE_KEYS]
    return keys


def apply_overrides(statements: list[ast.Stmt], overrides: dict[str, str],
                    sources: dict[str, str]) -> list[ast.Stmt]:
    """The statements with each override applied, in the order given."""
    statements = list(statements)
    lines: list[str] = []
    for key, value in overrides.items():
        key, value = str(key).strip(), str(value).strip()
        text = statement_text(key, value)
        lines.append(text)
        sources[OVERRIDE_FILE] = "\n".join(lines)
        stmt = _parse_one(text, len(lines), key, value)
        statements = _splice(statements, key, stmt)
    return statements


def _usage(message: str, hint: str | None = None) -> UsageError:
    return UsageError([error(None, message, hint)])


def statement_text(key: str, value: str) -> str:
    """The .zs line an override stands for."""
    if "\n" in value or "\r" in value or "\n" in key:
        raise _usage(f"--set {key}: the value must be on one line")
    if not value:
        raise _usage(f"--set {key}= needs a value", hint=f"--set {key}=VALUE")
    parts = key.split(".")
    head = parts[0]
    if key in TRAIN_KEYS or (head == "train" and len(parts) == 2 and parts[1] in TRAIN_KEYS):
        return f"train {parts[-1]}={value}"
    if key in OPTIMIZER_KEYS:
        return f"optimizer _({key}={value})"
    if head in CALL_STATEMENTS and len(parts) == 2 and parts[1].isidentifier():
        return f"{head} _({parts[1]}={value})"
    if key == "device":
        return f"ranks 1 on {value}"
    if key == "per_node":
        return f"ranks 1, {value} per node"
    if head == "offload" and len(parts) == 2 and parts[1] in STATES:
        return f"offload {parts[1]} -> {value}"
    if head == "offload" and len(parts) == 3 and parts[1] in STATES and parts[2] in OFFLOAD_KEYS:
        return f"offload {parts[1]} -> _({parts[2]}={value})"
    if head == "memory" and len(parts) == 2 and parts[1] in TIERS:
        return f"memory {parts[1]} {value}"
    if key == "persist" and not value.startswith("below"):
        return f"persist below {value}"
    if key in STATEMENT_KEYS:
        return f"{key} {value}"
    raise _usage(f"unknown --set key {key!r}",
                 hint=did_you_mean(key, known_keys()) or "keys are train and policy settings, "
                                                          "e.g. steps, zero, offload.optimizer")


def _parse_one(text: str, line: int, key: str, value: str) -> ast.Stmt:
    from zdsl.lang.parse import parse_text  # parse imports lark; keep this module light
    try:
        program = parse_text("\n" * (line - 1) + text, OVERRIDE_FILE)
    except ZsError as exc:
        raise UsageError(exc.diagnostics) from None
    if len(program.statements) != 1:
        raise _usage(f"--set {key}={value} is not one value")
    return program.statements[0]


def _splice(statements: list[ast.Stmt], key: str, new: ast.Stmt) -> list[ast.Stmt]:
    parts = key.split(".")
    if isinstance(new, ast.TrainStmt):
        return _merge_args(statements, "train", new, lambda s: s.args,
                           lambda s, args: dataclasses.replace(s, args=args))
    if key in OPTIMIZER_KEYS or (isinstance(new, ast.CallStmt) and len(parts) == 2):
        keyword = new.keyword
        return _merge_args(statements, keyword, new, lambda s: s.call.args,
                           lambda s, args: dataclasses.replace(
                               s, call=dataclasses.replace(s.call, args=args, has_parens=True)),
                           missing=lambda: _missing(keyword, key))
    if key in ("device", "per_node") and isinstance(new, ast.RanksStmt):      # one part of the ranks statement
        part = {"device": new.device} if key == "device" else {"per_node": new.per_node, "per_word": new.per_word}
        for i, s in enumerate(statements):
            if isinstance(s, ast.RanksStmt):
                statements[i] = dataclasses.replace(s, **part)
                return statements
        return statements + [new]
    if isinstance(new, ast.OffloadStmt):
        state = parts[1]
        found = next(((i, s) for i, s in enumerate(statements) if isinstance(s, ast.OffloadStmt)
                      and s.state.value == state), None)
        if len(parts) == 3:
            if found is None:
                raise _usage(f"--set {key}: the schedule does not offload {state}",
                             hint=f"--set offload.{state}=cpu first")
            index, old = found
            args = _replace_arg(old.target.args, new.target.args[0])
            statements[index] = dataclasses.replace(
                old, target=dataclasses.replace(old.target, args=args, has_parens=True))
            return statements
        if found is None:
            return statements + [new]
        statements[found[0]] = new
        return statements
    if isinstance(new, ast.MemoryStmt) and len(parts) == 2:
        tier = parts[1]
        out: list[ast.Stmt] = []
        for s in statements:
            if isinstance(s, ast.MemoryStmt):
                budgets = [b for b in s.budgets if b.tier.value != tier]
                if budgets:
                    out.append(dataclasses.replace(s, budgets=budgets))
            else:
                out.append(s)
        return out + [new]
    if isinstance(new, ast.LinkStmt):       # --set link="cluster=(...)" replaces the levels it names
        return _without_levels(statements, {a.key.value for a in new.args if a.key is not None}) + [new]
    if isinstance(new, ast.RanksStmt):      # --set ranks=N keeps the device and the ranks per node
        given = next((s for s in statements if isinstance(s, ast.RanksStmt)), None)
        if given is not None and new.device is None:
            new = dataclasses.replace(new, device=given.device)
        if given is not None and new.per_node is None:
            new = dataclasses.replace(new, per_node=given.per_node, per_word=given.per_word)
    replaced = {"zero", "shard"} if new.keyword in ("zero", "shard") else {new.keyword}
    return [s for s in statements if s.keyword not in replaced] + [new]


def _without_levels(statements: list[ast.Stmt], levels: set[str]) -> list[ast.Stmt]:
    """The statements with ``levels`` taken out of every ``link`` statement (one left with none, out)."""
    out: list[ast.Stmt] = []
    for s in statements:
        if isinstance(s, ast.LinkStmt):
            kept = [a for a in s.args if a.key is None or a.key.value not in levels]
            if not kept:
                continue
            s = dataclasses.replace(s, args=kept)
        out.append(s)
    return out


def _missing(keyword: str, key: str):
    if keyword == "model":
        raise _usage(f"--set {key}: the schedule has no model statement")
    return None


def _replace_arg(args: list[ast.Arg], new: ast.Arg) -> list[ast.Arg]:
    name = new.key.value if new.key is not None else None      # a positional one replaces nothing
    kept = [a for a in args if a.key is None or a.key.value != name]
    return kept + [new]


def _merge_args(statements, keyword, new, get_args, with_args, missing=None):
    """Set one key=value inside the (first) statement ``keyword``, adding it if absent."""
    for i, s in enumerate(statements):
        if s.keyword == keyword:
            statements[i] = with_args(s, _replace_arg(get_args(s), get_args(new)[0]))
            return statements
    if missing is not None:
        missing()
    if keyword == "optimizer":
        # An optimizer setting without an optimizer statement: the default optimizer.
        callee = ast.Name("adamw", new.call.callee.span)
        new = dataclasses.replace(new, call=dataclasses.replace(new.call, callee=callee))
    elif keyword in ("data", "machine"):
        ranks = next((s for s in statements if isinstance(s, ast.RanksStmt)), None)
        on_cuda = ranks is not None and ranks.device is not None and ranks.device.value == "cuda"
        base = "cuda" if on_cuda else "cpu"
        callee = ast.Name("synthetic" if keyword == "data" else base, new.call.callee.span)
        new = dataclasses.replace(new, call=dataclasses.replace(new.call, callee=callee))
    return statements + [new]


def parse_sets(items: list[str] | None, parser) -> dict[str, str]:
    """``--set key=value`` arguments as a dict; a malformed one ends the command through
    ``parser.error`` (an ``argparse.ArgumentParser``'s usage error)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            parser.error(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out
