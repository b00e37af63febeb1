"""The zdsl command: exit codes, positioned errors, plan output (table, JSON, trace), overrides."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

from work_count import lines_run
from zdsl import cli
from zdsl import driver
from zdsl import log
from zdsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(p for p in (ROOT / "programs").glob("*.zs"))
BUILTIN = [p for p in PROGRAMS if "gpt(" in p.read_text()]

SMALL = helpers.SMALL + "memory    device {budget}\n"


def write(tmp_path, text: str, name="s.zs") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run(argv, capsys):
    status = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


@pytest.mark.parametrize("program", BUILTIN, ids=lambda p: p.name)
def test_every_builtin_program_checks(program, capsys):
    status, out, err = run(["check", str(program)], capsys)
    assert status == 0, err
    assert f"{program}: ok" in out


def test_check_several_files_reports_the_worst(tmp_path, capsys):
    good = write(tmp_path, SMALL.format(budget="1GiB"), "good.zs")
    bad = write(tmp_path, "schedule x\nmodle gpt()\n", "bad.zs")
    status, out, err = run(["check", good, bad], capsys)
    assert status == 1
    assert f"{good}: ok" in out
    assert f"{bad}:2:1: error:" in err and "^" in err and "hint:" in err


def test_plan_table_has_every_section(tmp_path, capsys):
    status, out, err = run(["plan", write(tmp_path, SMALL.format(budget="1GiB"))], capsys)
    assert status == 0, err
    for part in ("memory per rank", "parameters", "gradients", "optimizer", "working", "ZeRO formula",
                 "communication per step", "predicted step", "compute", "comm", "critical path"):
        assert part in out


def test_plan_json_keys(tmp_path, capsys):
    status, out, _ = run(["plan", write(tmp_path, SMALL.format(budget="1GiB")), "--json"], capsys)
    assert status == 0
    data = json.loads(out)
    assert data["ranks"] == 2 and data["units"] == 4 and data["parameters"] > 0
    for tier in ("device", "host", "nvme"):
        assert set(data["memory"][tier]["model_states"]) == {"parameters", "gradients", "optimizer"}
        assert "working" in data["memory"][tier]
    assert data["memory"]["device"]["budget"] == 1 << 30
    assert data["comm_bytes_per_step"] > 0 and data["predicted_step_s"] > 0
    assert data["lanes"]["compute"] > 0 and "comm" in data["lanes"]


def test_plan_trace_is_a_chrome_trace(tmp_path, capsys):
    out_path = tmp_path / "pred.json"
    status, _, err = run(["plan", write(tmp_path, SMALL.format(budget="1GiB")), "--trace", str(out_path)],
                         capsys)
    assert status == 0 and "pred.json" in err
    events = json.loads(out_path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert {"compute", "comm"} <= {e["args"]["name"] for e in events if e.get("name") == "thread_name"}


def test_set_overrides_change_the_plan(tmp_path, capsys):
    path = write(tmp_path, SMALL.format(budget="1GiB"))
    _, out1, _ = run(["plan", path, "--json"], capsys)
    _, out2, _ = run(["plan", path, "--json", "--set", "zero=1", "--set", "steps=5"], capsys)
    assert json.loads(out1)["memory"]["device"]["model_states"] != json.loads(out2)["memory"]["device"]["model_states"]
    assert json.loads(out2)["stage"] == 1


def test_unknown_set_key_is_a_usage_error(tmp_path, capsys):
    status, _, err = run(["plan", write(tmp_path, SMALL.format(budget="1GiB")), "--set", "prefetc=2"], capsys)
    assert status == 2 and "prefetc" in err


def test_malformed_set_and_unknown_command_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", write(tmp_path, SMALL.format(budget="1GiB")), "--set", "prefetch"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_over_budget_fails_and_still_shows_the_plan(tmp_path, capsys):
    path = write(tmp_path, SMALL.format(budget="64KiB"))
    status, out, err = run(["plan", path], capsys)
    assert status == 1
    assert ":8:1: error: peak device memory" in err or "error: peak device memory" in err
    assert "exceeds the budget of 64.00 KiB" in err
    assert "memory per rank" in out
    status, _, _ = run(["check", path], capsys)
    assert status == 1


def test_budget_error_points_at_the_prefetch_statement(tmp_path, capsys):
    text = SMALL.replace("layers=2, width=32", "layers=6, width=256").replace("1 units ahead", "4 units ahead")
    path = write(tmp_path, text.format(budget="1GiB"))
    _, out, _ = run(["plan", path, "--json"], capsys)
    peak = json.loads(out)["memory"]["device"]["peak"]
    status, _, err = run(["check", path, "--set", f"memory.device={peak - 1}B"], capsys)
    assert status == 1
    assert f"{path}:8:1: error: peak device memory" in err and "hint: prefetch fewer units ahead" in err


def test_warnings_do_not_fail(tmp_path, capsys):
    text = SMALL.format(budget="1GiB, nvme 1TiB")
    status, out, err = run(["check", write(tmp_path, text)], capsys)
    assert status == 0 and "warning:" in err and "never reached" in err


def test_lowered_output_compiles_to_the_same_graph(tmp_path, capsys):
    from zdsl.driver import compile_file
    for program in BUILTIN:
        status, out, err = run(["plan", "--lowered", str(program)], capsys)
        assert status == 0, err
        lowered = write(tmp_path, out, program.name)
        a, b = compile_file(str(program), None), compile_file(lowered, None)
        assert a.ok and b.ok, (program, [d.message for d in b.diagnostics])
        assert same_graph(a.graph, b.graph), program.name


def same_graph(a, b) -> bool:
    """Equal ops (positions in the .zs file aside), buffers and units."""
    ops = lambda g: [{**op.__dict__, "span": None} for op in g.ops]  # noqa: E731
    return ops(a) == ops(b) and a.buffers == b.buffers and a.units == b.units


def test_missing_runtime_command_names_the_module(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "export", "zdsl.runtime.no_such_module_here")
    status, _, err = run(["export", "ckpt"], capsys)
    assert status == 2 and "zdsl.runtime.no_such_module_here is missing" in err


def test_every_subcommand_module_exists():
    import importlib.util
    for name, module_name in cli.DELEGATED.items():
        assert importlib.util.find_spec(module_name) is not None, (name, module_name)


def test_delegated_command_gets_its_arguments(monkeypatch, capsys):
    seen = {}
    fake = type(sys)("zdsl_fake_cli")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "zdsl_fake_cli", fake)
    monkeypatch.setitem(cli.DELEGATED, "inspect", "zdsl_fake_cli")
    status, _, _ = run(["--log-level", "info", "inspect", "ckpt", "--json", "--set", "a=b"], capsys)
    assert status == 0 and seen["argv"] == ["ckpt", "--json", "--set", "a=b"]


def test_a_bug_is_an_internal_error_not_a_traceback(monkeypatch, tmp_path, capsys):
    def boom(*a, **k):
        raise RuntimeError("kaboom")
    monkeypatch.setattr(cli, "cmd_check", boom)
    monkeypatch.delenv("ZDSL_DEBUG", raising=False)
    status, _, err = run(["check", "x.zs"], capsys)
    assert status == 3 and "zdsl: internal error: RuntimeError: kaboom" in err


def test_configure_logging_binds_the_rank(capsys):
    import structlog
    log.configure_logging(level="info")
    log.configure_logging(rank=1, level="info")
    structlog.get_logger().info("hello", x=1)
    err = capsys.readouterr().err
    assert "hello" in err and "rank=1" in err
    structlog.contextvars.clear_contextvars()


def test_console_script_end_to_end(tmp_path):
    bad = write(tmp_path, "schedule x\nzero 7\n\x00\xff", "bad.zs")
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "check", bad], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "bad.zs:" in proc.stderr


DIAGNOSTIC_HEADER = re.compile(r"^\S+:\d+:\d+: (error|warning|note): ")


def test_a_file_of_repeated_statements_checks_in_linear_work_and_prints_a_capped_list(tmp_path, capsys):
    """Checking is linear in the file (it was quadratic: 200,000 statements never finished), and
    the errors stop after 50 with a count."""
    def lines_for(n):      # the Python lines checking the file runs, less the schedule's own
        path = write(tmp_path, SMALL.format(budget="1GiB") + "zero 3\n" * n)
        return lines_run(main, ["check", path])[1]
    lines_for(0)                                                        # first-use work aside
    base = lines_for(0)
    assert (lines_for(2000) - base) / (lines_for(500) - base) < 6      # linear: 4, quadratic: 16
    capsys.readouterr()
    path = write(tmp_path, SMALL.format(budget="1GiB") + "zero 3\n" * 2000)
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "check", path], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    headers = [m.group(1) for m in map(DIAGNOSTIC_HEADER.match, lines) if m]
    assert headers.count("error") == 50 and headers.count("note") == 1 and len(headers) == 51
    assert lines[-1] == f"... and {2000 - 50} more errors in {path}"
    assert len(lines) < 10 * len(headers)


def test_report_caps_errors_and_warnings_separately(tmp_path, capsys):
    from zdsl.lang.errors import error
    from zdsl.lang.errors import note
    from zdsl.lang.errors import warning
    from zdsl.schedule import Span
    path = write(tmp_path, "zero 3\n" * 200)
    at = [Span(path, line, 1, 5) for line in range(1, 201)]
    compiled = driver.Compiled(path, [error(at[0], "e0"), note(at[1], "n0"),
                                   *(error(at[i], f"e{i}") for i in range(1, 60)),
                                   note(at[2], "n59"),                 # belongs to e59: left out
                                   *(warning(at[i], f"w{i}") for i in range(120))])
    driver.report(compiled)
    lines = capsys.readouterr().err.splitlines()
    headers = [line.split(": ", 2)[1:] for line in lines if DIAGNOSTIC_HEADER.match(line)]
    assert headers[:3] == [["error", "e0"], ["note", "n0"], ["error", "e1"]]
    assert [m for s, m in headers if s == "error"] == [f"e{i}" for i in range(50)]
    assert [m for s, m in headers if s == "warning"] == [f"w{i}" for i in range(50)]
    assert [m for s, m in headers if s == "note"] == ["n0"]
    assert lines[-2:] == [f"... and 10 more errors in {path}", f"... and 70 more warnings in {path}"]
    assert "    zero 3" in lines and "    ^~~~" in lines        # still positioned, with the line


def test_plan_says_which_rates_it_used_and_how_to_calibrate(tmp_path, capsys):
    path = write(tmp_path, SMALL.format(budget="1GiB"))
    status, out, err = run(["plan", path], capsys)
    assert status == 0, err
    rates = [line.strip() for line in out.splitlines() if line.strip().startswith("rates:")]
    assert rates == ["rates: zdsl's uncalibrated default 'cpu' profile; calibrate: "
                     "zdsl calibrate --out machine.zs, then include \"machine.zs\""]
    (tmp_path / "machine.zs").write_text("# measured\nmachine cpu(flops=1e11, link=3e9)\n")
    calibrated = write(tmp_path, SMALL.format(budget="1GiB") + 'include "machine.zs"\n', "c.zs")
    status, out, err = run(["plan", calibrated], capsys)
    assert status == 0, err
    assert f"rates: the 'cpu' profile of the machine statement at {tmp_path / 'machine.zs'}:2" in out
    assert "uncalibrated" not in out
    status, out, _ = run(["plan", calibrated, "--json"], capsys)
    assert json.loads(out)["machine"] == {"name": "cpu", "source": f"{tmp_path / 'machine.zs'}:2"}
    status, out, _ = run(["plan", path, "--json"], capsys)
    assert json.loads(out)["machine"] == {"name": "cpu", "source": "default"}


def test_plan_explains_the_worst_order_column(tmp_path, capsys):
    status, out, err = run(["plan", write(tmp_path, SMALL.format(budget="1GiB"))], capsys)
    assert status == 0, err
    header = next(line for line in out.splitlines() if "worst order" in line and "tier" in line)
    legend = [line.strip() for line in out.splitlines() if line.strip().startswith("worst order:")]
    assert header and legend == ["worst order: the working peak in the worst order the dependencies "
                                 "allow, which a run's timings can reach"]


def test_compiling_runs_no_cyclic_collection_and_restores_the_collector(tmp_path, monkeypatch):
    """Every collection walked the growing graph (compiling grew as depth^1.3); the compile pauses
    the collector and leaves it as it found it, also when it fails."""
    import gc
    deep = write(tmp_path, SMALL.format(budget="1GiB").replace("layers=2", "layers=300"))
    started, during = [], []
    real = driver._compile

    def compile_counted(*args):                    # the collections inside the compile itself
        before = len(started)
        out = real(*args)
        during.extend(started[before:])
        return out

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])
    monkeypatch.setattr(driver, "_compile", compile_counted)
    gc.callbacks.append(count)
    try:
        compiled = driver.compile_file(deep, None)
    finally:
        gc.callbacks.remove(count)
    assert compiled.ok and len(compiled.graph.units) == 302
    assert during == [] and gc.isenabled()
    gc.disable()
    try:
        driver.compile_file(deep, None, simulate=False)
        assert not gc.isenabled()                  # a caller's choice is kept
    finally:
        gc.enable()
    monkeypatch.setattr(driver, "_compile", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        driver.compile_file(deep, None)
    assert gc.isenabled()
