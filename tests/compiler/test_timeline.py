"""The timeline draws valid SVG: a row per (rank, lane), bars, a memory curve per tier."""
import json
import xml.etree.ElementTree as ET

import pytest

from zdsl.observe.timeline import TraceError

from zdsl.observe.timeline import main

from zdsl.observe.timeline import render_svg

from zdsl.observe.timeline import render_timeline

SVG = "{http://www.w3.org/2000/svg}"


def sample_trace(ranks=2, units=6, steps=2):
    """A ZeRO-3 step with NVMe-offloaded parameters, as `zdsl run --trace` records it (µs)."""
    lanes = ["compute", "comm", "nvme", "host"]
    ev = []
    for r in range(ranks):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, lane in enumerate(lanes):
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
    op_id = 0

    def x(r, lane, name, kind, ts, dur, step, unit, nbytes=0):
        nonlocal op_id
        op_id += 1
        ev.append({"ph": "X", "name": name, "pid": r, "tid": lanes.index(lane), "ts": ts, "dur": dur,
                   "args": {"op": op_id, "unit": unit, "kind": kind, "bytes": nbytes, "step": step}})

    for step in range(steps):
        base = step * 100_000.0
        for r in range(ranks):
            op_id = 0                         # SPMD: every rank runs the same graph, same op ids
            skew = 150.0 * r
            t = base + skew
            dev = 8 << 20
            ev.append({"ph": "C", "name": "memory.device", "pid": r, "ts": t, "args": {"bytes": dev}})
            ev.append({"ph": "C", "name": "memory.host", "pid": r, "ts": t, "args": {"bytes": 64 << 20}})
            ev.append({"ph": "C", "name": "memory.nvme", "pid": r, "ts": t, "args": {"bytes": 200 << 20}})
            for u in range(units):          # forward: read, gather, compute
                x(r, "nvme", f"read p{u}", "nvme.read", t, 1500.0, step, u, 4 << 20)
                x(r, "comm", f"gather p{u}", "comm.all_gather", t + 1600, 1800.0, step, u, 8 << 20)
                x(r, "compute", f"fwd {u}", "compute.forward", t + 3500, 2600.0, step, u)
                x(r, "compute", f"free p{u}", "mem.free", t + 6100, 0.0, step, u)
                dev += 6 << 20
                ev.append({"ph": "C", "name": "memory.device", "pid": r, "ts": t + 3500,
                           "args": {"bytes": dev}})
                t += 3000.0
            t += 3200.0                       # the last forward ends
            for u in reversed(range(units)):  # backward: gather, recompute, compute, scatter, step
                x(r, "comm", f"gather p{u}", "comm.all_gather", t, 1800.0, step, u, 8 << 20)
                x(r, "compute", f"recomp {u}", "compute.recompute", t + 1900, 1500.0, step, u)
                x(r, "compute", f"bwd {u}", "compute.backward", t + 3400, 4200.0, step, u)
                x(r, "comm", f"scatter g{u}", "comm.reduce_scatter", t + 7700, 2000.0, step, u, 8 << 20)
                x(r, "host", f"step {u}", "compute.step", t + 9800, 2500.0, step, u)
                x(r, "nvme", f"write o{u}", "nvme.write", t + 12400, 1800.0, step, u, 12 << 20)
                dev -= 6 << 20
                ev.append({"ph": "C", "name": "memory.device", "pid": r, "ts": t + 7600,
                           "args": {"bytes": dev}})
                ev.append({"ph": "C", "name": "memory.host", "pid": r, "ts": t + 9800,
                           "args": {"bytes": (64 + 12 * (units - u)) << 20}})
                t += 5800.0
    return {"traceEvents": ev}


def parse(svg_text):
    return ET.fromstring(svg_text)


def test_rows_bars_and_memory_curve(tmp_path):
    out = tmp_path / "t.svg"
    render_timeline(sample_trace(), out, title="ZeRO-3 + NVMe")
    root = parse(out.read_text())
    assert root.tag == SVG + "svg"
    lanes = [(t.get("data-rank"), t.text) for t in root.iter(SVG + "text") if t.get("class") == "lane"]
    assert lanes == [(str(r), lane) for r in (0, 1) for lane in ("compute", "comm", "nvme", "host")]
    bars = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(bars) == 2 * 6 * (3 + 6)            # frees hidden; last step only
    curves = {(p.get("data-rank"), p.get("data-tier")) for p in root.iter(SVG + "path")
              if p.get("class") == "memory"}
    assert curves == {(str(r), t) for r in (0, 1) for t in ("device", "host", "nvme")}
    text = "".join(t.text or "" for t in root.iter(SVG + "text"))
    assert "ZeRO-3 + NVMe" in text and "step 1" in text and "all-gather" in text and "fwd 3" in text


def test_step_choice_and_plain_lane_names(tmp_path):
    ev = [{"ph": "X", "name": "fwd <0>", "pid": 0, "tid": "compute", "ts": 10.0, "dur": 5.0,
           "args": {"kind": "compute.forward"}},
          {"ph": "X", "name": "odd & new", "pid": 0, "tid": "comm", "ts": 12.0, "dur": 5.0,
           "args": {"kind": "something.else"}}]
    root = parse(render_svg(ev))                    # a bare list, tids that are lane names
    lanes = [t.text for t in root.iter(SVG + "text") if t.get("class") == "lane"]
    assert lanes == ["compute", "comm"]
    assert not [p for p in root.iter(SVG + "path") if p.get("class") == "memory"]
    first = parse(render_svg(sample_trace(), step=0))
    assert any("step 0" in (t.text or "") for t in first.iter(SVG + "text"))


def test_bad_traces_are_clear_errors(tmp_path, capsys):
    with pytest.raises(TraceError, match="no complete"):
        render_svg({"traceEvents": []})
    with pytest.raises(TraceError, match="not in the trace"):
        render_svg(sample_trace(), step=7)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), str(tmp_path / "o.svg")]) == 2
    assert "not JSON" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(sample_trace()))
    assert main([str(good), str(tmp_path / "o.svg")]) == 0
    parse((tmp_path / "o.svg").read_text())


def test_compare_draws_the_prediction_under_the_measurement():
    measured = sample_trace()
    predicted = sample_trace(steps=1)
    predicted["metadata"] = {"source": "zdsl plan (predicted)"}
    root = parse(render_svg(measured, compare=predicted))
    lanes = [(t.get("data-source"), t.get("data-rank")) for t in root.iter(SVG + "text")
             if t.get("class") == "lane"]
    assert lanes == [("measured", "0")] * 4 + [("measured", "1")] * 4 + [("predicted", "0")] * 4
    heads = [t.text for t in root.iter(SVG + "text")
             if t.get("font-size") == "12" and (t.text or "").startswith(("measured ·", "predicted ·"))]
    assert heads == ["measured · rank 0", "measured · rank 1", "predicted · rank 0"]


def test_critical_path_is_outlined():
    trace = sample_trace(steps=1)
    ops = [e["args"]["op"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0][:3]
    root = parse(render_svg(trace, critical=ops))
    outlined = [r for r in root.iter(SVG + "rect")
                if r.get("stroke") == "#111111" and r.find(SVG + "title") is not None]
    assert len(outlined) == 3 * 2                                  # a set applies to every rank
    root = parse(render_svg(trace, critical={1: ops}))
    assert len([r for r in root.iter(SVG + "rect") if r.get("stroke") == "#111111"
                and r.find(SVG + "title") is not None]) == 3


def test_a_step_of_frees_alone_still_draws_its_memory():
    """Frees are hidden, so such a step has no lane to draw; its memory curve is still drawn."""
    trace = {"traceEvents": [
        {"ph": "X", "name": "free", "ts": 0, "dur": 1, "pid": 0, "tid": "compute",
         "args": {"op": 0, "unit": 0, "kind": "mem.free", "bytes": 0}},
        {"ph": "C", "name": "memory.host", "ts": 0, "pid": 0, "args": {"bytes": 100}},
        {"ph": "C", "name": "memory.host", "ts": 1, "pid": 0, "args": {"bytes": 0}}]}
    svg = render_svg(trace)
    assert svg.count('class="memory"') == 1 and 'data-tier="host"' in svg
