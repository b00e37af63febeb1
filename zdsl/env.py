"""Every environment variable zdsl reads, in one registry, read only through it; ``zdsl env`` shows it.

What a run does is in the schedule. The environment holds what a launcher tells each rank, a few
settings of the machine rather than the schedule, diagnostics, and the test suite's switches.
The accessors refuse a name that is not registered (:class:`UnregisteredVariable`), and
tests/compiler/test_env.py fails on a read of ``os.environ`` anywhere else in zdsl/ or runtime/,
so no variable can be read without being listed here, and so shown to users.

Torch-free: the compiler's ``zdsl env`` and the runtime both import it.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass

KNOB = "knob"                  # a setting of this machine a user may change
DIAGNOSTIC = "diagnostic"      # to look into or test zdsl, not to train with
LAUNCHER_SET = "launcher-set"  # what a launcher tells each rank
STANDARD = "standard"          # a convention shared with other tools
TEST = "test"                  # read by the test suite only
KINDS = (KNOB, DIAGNOSTIC, LAUNCHER_SET, STANDARD, TEST)


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    set_by: str
    meaning: str
    default: str | None = None    # what get() returns when unset; None: nothing


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("ZDSL_LOG", KNOB, "user", "log level on stderr: debug, info, warning or error "
             "(--log-level wins)", "warning"),
    Variable("ZDSL_BIND_CORES", KNOB, "user", "0 leaves the ranks of a CPU run unbound; else each is bound to "
             "its share of the host's cores (as DeepSpeed's --bind_cores_to_rank)", "1"),
    Variable("ZDSL_GLOO_LOOP_POLICY", KNOB, "user", "scheduling policy of gloo's event-loop threads: batch "
             "(never preempt the thread they wake), normal or idle", "batch"),
    Variable("ZDSL_CACHE", KNOB, "user", "where built C kernels, the measured torch memory floor, "
             "this machine's calibrated profile and Hugging Face and users' models' sizings are kept", "~/.cache/zdsl"),
    Variable("ZDSL_CALIBRATE", KNOB, "user", "0: plan, tune and run --trace use zdsl's default machine "
             "profile, neither calibrating this machine nor reading its cached profile (as --no-calibrate)", "1"),
    Variable("ZDSL_DEBUG", DIAGNOSTIC, "user", "1 prints the traceback of an internal error and of a "
             "rank's failure"),
    Variable("ZDSL_NO_NATIVE", DIAGNOSTIC, "user", "1 builds no C kernel: the host AdamW step runs ATen's "
             "(to test or compare the fallback)"),
    Variable("ZDSL_ONE_STREAM", DIAGNOSTIC, "user", "1 runs every device lane of a CUDA rank on one stream: the "
             "same ops without overlap, to compare an overlapped run against"),
    Variable("ZDSL_HB_CHECK", DIAGNOSTIC, "user", "1 runs a CPU run's steps under the happens-before checker: the "
             "CUDA path's stream ordering checked as if on a GPU; a race fails the run (runtime/exec/hb_check.py)"),
    Variable("ZDSL_SIM_NODES", DIAGNOSTIC, "benchmarks/hierarchy.py", "P:RATE simulates nodes of P ranks on this "
             "machine: a collective whose group spans them completes bytes/RATE seconds later (a simulation, "
             "runtime/dist/sim_nodes.py)"),
    Variable("ZDSL_FAULT", DIAGNOSTIC, "tests", "RANK:OP[:raise|kill|hang[:STEP]]: that rank fails at that op "
             "(fault injection)"),
    Variable("ZDSL_ERROR_FILE", LAUNCHER_SET, "zdsl run", "where a rank leaves its error for the launcher; "
             "its progress board lies beside it"),
    Variable("ZDSL_LAUNCH_TIMEOUT", LAUNCHER_SET, "zdsl launch", "its --timeout; set, the script runs under "
             "zdsl launch: zdsl.initialize() checks the schedule fits first, and waits this long for peers where "
             "the script gives no timeout_s"),
    Variable("ZDSL_IGNORE_LIMITS", LAUNCHER_SET, "zdsl launch", "1: its --ignore-limits: initialize() trains "
             "where the ranks do not fit this machine, with a warning"),
    Variable("RANK", LAUNCHER_SET, "launcher", "this process's rank; unset, `zdsl run` is the launcher"),
    Variable("WORLD_SIZE", LAUNCHER_SET, "launcher", "how many ranks the run has"),
    Variable("LOCAL_RANK", LAUNCHER_SET, "launcher", "this rank's index on its host (its GPU, its cores)"),
    Variable("LOCAL_WORLD_SIZE", LAUNCHER_SET, "launcher", "how many ranks run on this host"),
    Variable("MASTER_ADDR", LAUNCHER_SET, "launcher", "rendezvous host of the process group"),
    Variable("MASTER_PORT", LAUNCHER_SET, "launcher", "rendezvous port of the process group"),
    Variable("CC", STANDARD, "user", "the C compiler for the kernels (else the first of cc, gcc, clang)"),
    Variable("CUDA_VISIBLE_DEVICES", STANDARD, "user", "empty or -1: no GPU, so `ranks N` without a device "
             "counts as host memory when zdsl checks a schedule fits"),
    Variable("OMP_NUM_THREADS", STANDARD, "user", "set: torch's threads in a CPU rank follow it, not the rank's "
             "share of the cores"),
    Variable("ZDSL_PARITY_STEPS", TEST, "developer", "steps of the DDP parity tests (more to study drift)", "5"),
    Variable("ZDSL_TEST_4_RANKS", TEST, "developer", "1 runs the 4-rank parity test (it oversubscribes "
             "a 2-core machine)"),
)}

# What a launcher sets for one rank: dropped from the environment of a process that is no rank.
LAUNCHER_VARIABLES = tuple(name for name, v in VARIABLES.items() if v.kind == LAUNCHER_SET)


class UnregisteredVariable(KeyError):
    """A read of a variable the registry does not list: a bug in zdsl (register it first)."""


def variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise UnregisteredVariable(f"{name} is not in zdsl/env.py's registry: list it there "
                                   f"(kind, who sets it, meaning, default) before reading it") from None


def raw(name: str) -> str | None:
    """The value exactly as set (an empty string too), None when unset: for the variables whose
    being set, even empty, means something (CUDA_VISIBLE_DEVICES="", RANK, OMP_NUM_THREADS)."""
    variable(name)
    return os.environ.get(name)


def get(name: str) -> str | None:
    """The value; the registered default when unset or empty."""
    default = variable(name).default
    return os.environ.get(name) or default


def flag(name: str) -> bool:
    """On unless the value (or, unset or empty, the default) is missing or ``0``."""
    return get(name) not in (None, "0")


def integer(name: str) -> int | None:
    """The value as a whole number (the default when unset or empty; None without one);
    ValueError naming the variable when it is not one."""
    text = get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a whole number") from None


def child_environment(drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """This process's environment for a child: without ``drop``, with ``values`` set (all registered)."""
    for name in (*drop, *values):
        variable(name)
    out = {k: v for k, v in os.environ.items() if k not in drop}
    out.update(values)
    return out


def export(**values: str) -> None:
    """Set registered variables in this process's environment, as a launcher would have (a spawned rank)."""
    for name in values:
        variable(name)
    os.environ.update(values)


def render(color: bool = False, width: int | None = None) -> str:
    """The registry as a table: each variable's kind, who sets it, default, value here and meaning."""
    from rich.console import Console  # only zdsl env
    from rich.table import Table

    table = Table(title="environment variables zdsl reads (zdsl/env.py)", title_justify="left")
    table.add_column("variable", no_wrap=True, style="bold")
    table.add_column("kind", no_wrap=True)
    table.add_column("set by", no_wrap=True)
    table.add_column("default", overflow="fold")
    table.add_column("value here", overflow="fold")
    table.add_column("meaning", ratio=1)
    for kind in KINDS:
        rows = [v for v in VARIABLES.values() if v.kind == kind]
        for i, v in enumerate(rows):
            value = os.environ.get(v.name)
            table.add_row(v.name, v.kind, v.set_by, "-" if v.default is None else v.default,
                          "-" if value is None else repr(value) if not value else value, v.meaning,
                          end_section=i == len(rows) - 1, style=None if value is None else "green")
    buf = io.StringIO()
    Console(file=buf, width=width or 160, force_terminal=color, color_system="standard" if color else None,
            highlight=False).print(table)
    return buf.getvalue()
