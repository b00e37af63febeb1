"""One step of a trace as an SVG picture: what overlaps, what waits, what memory holds.

Input is the Chrome trace format that ``zdsl run --trace`` records and
``zdsl plan`` predicts (``{"traceEvents": [...]}`` or the bare list):

* ``"X"`` complete events: ``name``, ``ts`` and ``dur`` in microseconds,
  ``pid`` = rank, ``tid`` = lane (named by ``"M"`` ``thread_name`` events, or
  the lane name itself), ``args`` = ``{op, unit, kind, bytes, step?}``;
* ``"C"`` counter events named ``memory.<tier>`` with ``args.bytes``.

The picture has a row per (rank, lane) with a bar per op coloured by kind
(frees are bookkeeping and hidden), each lane's busy share, a millisecond
axis, a legend, and under the lanes a step curve of bytes held per tier.
It is written as plain SVG text (no plotting library, no torch) so
``zdsl plan`` can draw a prediction without the runtime installed.

``python -m zdsl.observe.timeline TRACE.json OUT.svg [--step N] [--title T] [--compare PREDICTED.json]``
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from xml.sax.saxutils import escape

from zdsl.ir import TIERS
from zdsl.lang.sizes import human_bytes

# -- what the bars mean ----------------------------------------------------------

# op kind -> (legend label, fill colour); order here is legend order.
KIND_STYLE = {
    "compute.forward": ("forward", "#4e79a7"),
    "compute.backward": ("backward", "#f28e2b"),
    "compute.recompute": ("recompute", "#edc948"),
    "compute.step": ("optimizer step", "#59a14f"),
    "compute.norm": ("grad norm", "#b07aa1"),
    "comm.all_gather": ("all-gather", "#76b7b2"),
    "comm.reduce_scatter": ("reduce-scatter", "#e15759"),
    "comm.all_reduce": ("all-reduce", "#ff9da7"),
    "copy.h2d": ("copy to device", "#9c755f"),
    "copy.d2h": ("copy to host", "#c49c80"),
    "nvme.read": ("nvme read", "#8c8c8c"),
    "nvme.write": ("nvme write", "#5a5a5a"),
}
OTHER_STYLE = ("other", "#d0d0d0")
HIDDEN_KINDS = ("mem.free",)
LANE_ORDER = ("compute", "comm", "h2d", "d2h", "nvme", "host")
TIER_COLOURS = {"device": "#1f4e8c", "host": "#b5530f", "nvme": "#2e7d32"}
EXTRA_TIER_COLOURS = ("#6a3d9a", "#8c564b", "#444444")

# -- layout (pixels) -------------------------------------------------------------
WIDTH = 1280
LEFT = 170          # lane labels
RIGHT = 24
TOP = 74            # title, subtitle, top axis
ROW = 22            # one lane
BAR = 16            # bar height inside a row
SUB_ROW = 16        # a lane whose ops overlap (async collectives) stacks them, one sub-row each
SUB_BAR = 13
RANK_HEAD = 20      # "rank 0" header above a rank's lanes
RANK_GAP = 10
MEM_BAND = 46       # memory: one band per tier
MEM_GAP = 8
FONT = "font-family=\"Helvetica, Arial, sans-serif\""
CHAR_W = 6.1        # average glyph width at font-size 10, for label fitting


@dataclass
class Bar:
    rank: int | tuple[int, int]     # the trace's rank; once merged, (the trace's index, its rank)
    lane: str
    start: float     # µs since the step's first op
    dur: float
    name: str
    kind: str
    bytes: int
    unit: object = None
    op: int | None = None


class TraceError(ValueError):
    """The trace cannot be drawn (said in words for the user)."""


def _events(trace) -> list[dict]:
    if isinstance(trace, dict):
        trace = trace.get("traceEvents")
    if not isinstance(trace, list):
        raise TraceError("not a Chrome trace: expected {\"traceEvents\": [...]} or a list of events")
    return [e for e in trace if isinstance(e, dict)]


def _lane_names(events: list[dict]) -> dict[tuple, str]:
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid", 0), e.get("tid"))] = str((e.get("args") or {}).get("name", e.get("tid")))
    return names


def _kind_of(e: dict) -> str:
    args = e.get("args") or {}
    kind = args.get("kind") or e.get("cat") or e.get("name", "")
    return str(kind)


def _select_step(xs: list[dict], step: int | None) -> tuple[list[dict], int | None]:
    steps = sorted({(e.get("args") or {}).get("step") for e in xs} - {None}, key=str)
    if not steps:
        if step is not None:
            raise TraceError(f"step {step} asked for, but the trace's events carry no step number")
        return xs, None
    want = steps[-1] if step is None else step
    if want not in steps:
        raise TraceError(f"step {step} is not in the trace (it has steps {', '.join(map(str, steps))})")
    return [e for e in xs if (e.get("args") or {}).get("step") == want], want


def _nice_step(span: float, target: int) -> float:
    """1, 2 or 5 times a power of ten, giving about ``target`` ticks over ``span``."""
    raw = span / max(1, target)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt_ms(us: float, tick: float) -> str:
    decimals = max(0, -math.floor(math.log10(tick / 1000.0))) if tick < 1000 else 0
    return f"{us / 1000.0:.{decimals}f}"


def _nice_ceiling_bytes(n: float) -> float:
    """A round axis top at or above ``n``, in the binary unit it is shown in (e.g. 48 MiB)."""
    if n <= 0:
        return 1.0
    size = next((s for s in (1 << 30, 1 << 20, 1 << 10) if n >= s), 1)
    v = n / size
    mag = 10 ** math.floor(math.log10(v))
    top = next(m * mag for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if v <= m * mag * (1 + 1e-9))
    return top * size


def _fmt_dur(us: float) -> str:
    return f"{us / 1000:.3g} ms" if us >= 1000 else f"{us:.3g} µs"


def _text_colour(fill: str) -> str:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#1a1a1a" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def _lane_rank(lane: str) -> tuple:
    return (LANE_ORDER.index(lane), "") if lane in LANE_ORDER else (len(LANE_ORDER), lane)


def _busy(bars: list[Bar]) -> float:
    total, end = 0.0, -math.inf
    for b in sorted(bars, key=lambda b: b.start):
        s, e = b.start, b.start + b.dur
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _memory_curves(events: list[dict], t0: float, t1: float) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(rank, tier) -> [(µs since t0, bytes)], a step function over the window."""
    series: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("ph") != "C" or not name.startswith("memory."):
            continue
        args = e.get("args") or {}
        val = args.get("bytes", next((v for v in args.values() if isinstance(v, (int, float))), None))
        if not isinstance(val, (int, float)) or not isinstance(e.get("ts"), (int, float)):
            continue
        series.setdefault((e.get("pid", 0), name[len("memory."):]), []).append((float(e["ts"]), float(val)))
    curves = {}
    for key, pts in series.items():
        pts.sort()
        before = [v for t, v in pts if t <= t0]
        inside = [(t - t0, v) for t, v in pts if t0 < t <= t1]
        if not before and not inside:
            continue
        start = before[-1] if before else 0.0
        curves[key] = [(0.0, start)] + inside
    return curves


def collect(trace, step: int | None = None):
    """The bars of one step, the lanes they sit in, memory curves, and the step's span (µs)."""
    events = _events(trace)
    names = _lane_names(events)
    xs = [e for e in events if e.get("ph") == "X"
          and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur", 0), (int, float))]
    if not xs:
        raise TraceError("the trace has no complete (\"X\") events to draw")
    xs, chosen = _select_step(xs, step)
    t0 = min(float(e["ts"]) for e in xs)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in xs)
    bars = []
    for e in xs:
        kind = _kind_of(e)
        if kind in HIDDEN_KINDS:
            continue
        pid, tid = e.get("pid", 0), e.get("tid", 0)
        rank = pid if isinstance(pid, int) else 0
        lane = names.get((pid, tid), str(tid))
        args = e.get("args") or {}
        nbytes = args.get("bytes", 0)
        bars.append(Bar(rank, lane, float(e["ts"]) - t0, float(e.get("dur", 0)), str(e.get("name", kind)),
                        kind, nbytes if isinstance(nbytes, int) else 0, args.get("unit"),
                        args.get("op") if isinstance(args.get("op"), int) else None))
    lanes = sorted({(b.rank, b.lane) for b in bars}, key=lambda rl: (rl[0], _lane_rank(rl[1])))
    return bars, lanes, _memory_curves(events, t0, t1), t1 - t0, chosen


def _merge(sources: list[tuple[str, object, int | None]]):
    """Several traces on one time axis; a group is (source index, rank)."""
    bars, lanes, curves, spans, chosen = [], [], {}, [], []
    for i, (_, trace, step) in enumerate(sources):
        b, ln, cv, span, ch = collect(trace, step)
        if i > 0:   # a compared trace (a prediction: SPMD, every rank alike) shows its first rank
            first = min(r for r, _ in ln)
            b = [bar for bar in b if bar.rank == first]
            ln = [(r, lane) for r, lane in ln if r == first]
            cv = {k: v for k, v in cv.items() if k[0] == first}
        for bar in b:
            bar.rank = (i, bar.rank)
        bars += b
        lanes += [((i, r), lane) for r, lane in ln]
        curves.update({((i, r), tier): pts for (r, tier), pts in cv.items()})
        spans.append(span)
        chosen.append(ch)
    return bars, lanes, curves, spans, chosen


@dataclass
class _Layout:
    """Where one picture's parts go: the merged traces, each bar's sub-row, each lane's and
    rank group's top, the memory bands and the legend, all in pixels (µs mapped by :meth:`x_of`)."""
    sources: list[tuple[str, object, int | None]]
    compare: bool
    bars: list[Bar]
    lanes: list[tuple]
    curves: dict
    spans: list[float]
    chosen: int | None
    span: float
    critical: set | dict | None
    by_lane: dict[tuple, list[Bar]]
    level: dict[int, int]                   # id(bar) -> its sub-row in its lane
    levels: dict[tuple, int]                # lane -> how many sub-rows it has
    lane_h: dict[tuple, float]
    lane_y: dict[tuple, float]
    rank_y: dict[tuple, float]              # group -> the top of its header
    lanes_bottom: float
    tiers: list[str]
    colours: dict[str, str]
    mem_top: float
    mem_bottom: float
    legend_items: list[tuple[str, str]]
    legend_top: float
    per_row: int
    legend_rows: int
    height: float
    plot_w: int = WIDTH - LEFT - RIGHT

    def x_of(self, us: float) -> float:
        return LEFT + self.plot_w * us / self.span

    def group_label(self, group) -> str:
        i, r = group
        return f"{self.sources[i][0]} · rank {r}" if self.compare else f"rank {r}"

    def on_critical(self, b: Bar) -> bool:
        """Whether ``b`` is outlined: only the first trace's ops are on its critical path."""
        return _on_critical(self.critical, b)


def _critical_ids(critical) -> set | dict | None:
    """The user's ``critical`` (op ids, or rank -> op ids) as sets."""
    if critical is None:
        return None
    return {r: set(v) for r, v in critical.items()} if isinstance(critical, dict) else set(critical)


def _on_critical(critical, b: Bar) -> bool:
    if critical is None or b.op is None or not isinstance(b.rank, tuple) or b.rank[0] != 0:
        return False
    ids = critical.get(b.rank[1], ()) if isinstance(critical, dict) else critical
    return b.op in ids


def _sub_rows(bars: list[Bar], span: float, plot_w: int):
    """Ops of a lane that overlap in time (collectives in flight together) go on sub-rows:
    the bars by lane, each bar's sub-row (by ``id``) and each lane's count of sub-rows."""
    by_lane: dict[tuple, list[Bar]] = {}
    for b in bars:
        by_lane.setdefault((b.rank, b.lane), []).append(b)
    level: dict[int, int] = {}
    levels: dict[tuple, int] = {}
    slack = span / plot_w          # overlaps under a pixel are timing noise, not concurrency
    for key, lane_bars in by_lane.items():
        ends: list[float] = []
        for b in sorted(lane_bars, key=lambda b: b.start):
            lvl = next((i for i, e in enumerate(ends) if e <= b.start + slack), len(ends))
            if lvl == len(ends):
                ends.append(0.0)
            ends[lvl] = b.start + b.dur
            level[id(b)] = lvl
        levels[key] = max(1, len(ends))
    return by_lane, level, levels


def _lane_tops(lanes: list[tuple], lane_h: dict[tuple, float]):
    """Each lane's top and each rank group's header top, and where the last lane ends."""
    lane_y: dict[tuple, float] = {}
    rank_y: dict[tuple, float] = {}
    y: float = TOP
    for rank, lane in lanes:
        if rank not in rank_y:
            if rank_y:
                y += RANK_GAP
            rank_y[rank] = y
            y += RANK_HEAD
        lane_y[(rank, lane)] = y
        y += lane_h[(rank, lane)]
    return lane_y, rank_y, y


def _tier_colours(curves: dict) -> tuple[list[str], dict[str, str]]:
    """The memory tiers drawn, in tier order, and the colour of each."""
    tiers = sorted({t for _, t in curves}, key=lambda t: (TIERS.index(t) if t in TIERS else 9, t))
    colours = {t: TIER_COLOURS.get(t, EXTRA_TIER_COLOURS[i % len(EXTRA_TIER_COLOURS)])
               for i, t in enumerate(tiers)}
    return tiers, colours


def _legend_items(bars: list[Bar], critical) -> list[tuple[str, str]]:
    """(label, fill) of each op kind drawn, in ``KIND_STYLE`` order, then other and the outline."""
    kinds_seen = [k for k in KIND_STYLE if any(b.kind == k for b in bars)]
    has_other = any(b.kind not in KIND_STYLE for b in bars)
    items = [KIND_STYLE[k] for k in kinds_seen] + ([OTHER_STYLE] if has_other else [])
    if critical and any(_on_critical(critical, b) for b in bars):
        items.append(("critical path", "outline"))
    return items


def _layout(sources: list[tuple[str, object, int | None]], compare: bool, critical) -> _Layout:
    bars, lanes, curves, spans, chosens = _merge(sources)
    span = max(spans) or 1.0
    plot_w = WIDTH - LEFT - RIGHT
    by_lane, level, levels = _sub_rows(bars, span, plot_w)
    lane_h = {key: ROW if levels.get(key, 1) == 1 else levels[key] * SUB_ROW + 6 for key in lanes}
    lane_y, rank_y, lanes_bottom = _lane_tops(lanes, lane_h)
    tiers, colours = _tier_colours(curves)
    mem_top = lanes_bottom + 44
    mem_bottom = mem_top + len(tiers) * (MEM_BAND + MEM_GAP) - (MEM_GAP if tiers else 0)
    critical = _critical_ids(critical)
    legend_items = _legend_items(bars, critical)
    legend_top = mem_bottom + 40
    per_row = max(1, plot_w // 124)
    legend_rows = math.ceil(len(legend_items) / per_row) if legend_items else 0
    height = legend_top + 18 * (legend_rows + (1 if curves and len(rank_y) > 1 else 0)) + 10
    return _Layout(sources, compare, bars, lanes, curves, spans, chosens[0], span, critical,
                   by_lane, level, levels, lane_h, lane_y, rank_y, lanes_bottom, tiers, colours,
                   mem_top, mem_bottom, legend_items, legend_top, per_row, legend_rows, height, plot_w)


def _draw_heading(w, lay: _Layout, title: str | None) -> None:
    """The svg element, its white ground, the title and a line of what the picture shows."""
    w(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{lay.height:.0f}" '
      f'viewBox="0 0 {WIDTH} {lay.height:.0f}" {FONT} font-size="10">')
    w(f'<rect x="0" y="0" width="{WIDTH}" height="{lay.height:.0f}" fill="#ffffff"/>')
    heading = title or "zdsl timeline"
    w(f'<text x="{LEFT}" y="24" font-size="16" font-weight="bold" fill="#1a1a1a">{escape(heading)}</text>')
    n_ranks = len({r for _, r in lay.rank_y})
    sub = [f"step {lay.chosen}" if lay.chosen is not None else "one step"]
    if lay.compare:
        sub += [f"{label} {sp / 1000:.2f} ms" for (label, _, _), sp in zip(lay.sources, lay.spans)]
    else:
        sub.append(f"{lay.span / 1000:.2f} ms")
    sub += [f"{n_ranks} rank{'s' if n_ranks != 1 else ''}", f"{len(lay.bars)} ops drawn (frees hidden)"]
    w(f'<text x="{LEFT}" y="42" font-size="11" fill="#555555">{escape(" · ".join(sub))}</text>')


def _draw_lanes(w, lay: _Layout) -> None:
    """A header per rank group, then a row per lane: its name and its busy share."""
    for rank, ry in lay.rank_y.items():
        w(f'<text x="8" y="{ry + 14}" font-size="12" font-weight="bold" fill="#1a1a1a">'
          f'{escape(lay.group_label(rank))}</text>')
        w(f'<line x1="8" y1="{ry + RANK_HEAD - 2}" x2="{WIDTH - RIGHT}" y2="{ry + RANK_HEAD - 2}" '
          f'stroke="#bbbbbb" stroke-width="0.5"/>')
    for i, key in enumerate(lay.lanes):
        ly, h = lay.lane_y[key], lay.lane_h[key]
        if i % 2 == 0:
            w(f'<rect x="{LEFT}" y="{ly}" width="{lay.plot_w}" height="{h}" fill="#f6f7f9"/>')
        share = _busy(lay.by_lane.get(key, [])) / (lay.spans[key[0][0]] or 1.0)
        w(f'<text x="20" y="{ly + h / 2 + 4:.1f}" font-size="11" fill="#1a1a1a" '
          f'class="lane" data-source="{escape(lay.sources[key[0][0]][0])}" data-rank="{key[0][1]}" '
          f'data-lane="{escape(key[1])}">{escape(key[1])}</text>')
        w(f'<text x="{LEFT - 8}" y="{ly + h / 2 + 4:.1f}" text-anchor="end" fill="#777777">'
          f'{share:.0%} busy</text>')


def _draw_time_axis(w, lay: _Layout) -> None:
    """The time grid, down through the memory bands, and millisecond labels above and below the lanes."""
    tick = _nice_step(lay.span, 12)
    ticks = [i * tick for i in range(int(lay.span / tick) + 1)]
    grid_bottom = lay.mem_bottom if lay.curves else lay.lanes_bottom
    w('<g stroke="#e6e6e6" stroke-width="1">')
    for t in ticks:
        x = lay.x_of(t)
        w(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{grid_bottom:.1f}"/>')
    w('</g>')
    w('<g fill="#555555" text-anchor="middle">')
    for t in ticks:
        w(f'<text x="{lay.x_of(t):.1f}" y="{TOP - 10}">{_fmt_ms(t, tick)}</text>')
        w(f'<text x="{lay.x_of(t):.1f}" y="{lay.lanes_bottom + 14:.1f}">{_fmt_ms(t, tick)}</text>')
    w('</g>')
    w(f'<text x="{LEFT - 24}" y="{TOP - 10}" text-anchor="end" fill="#555555">ms</text>')
    w(f'<text x="{LEFT - 24}" y="{lay.lanes_bottom + 14:.1f}" text-anchor="end" fill="#555555">ms</text>')


def _bar_box(lay: _Layout, b: Bar) -> tuple[float, float]:
    """The bar's top and height: centred in its lane, or in its sub-row where the lane has several."""
    key = (b.rank, b.lane)
    if lay.levels[key] == 1:
        return lay.lane_y[key] + (ROW - BAR) / 2, BAR
    return lay.lane_y[key] + 3 + lay.level[id(b)] * SUB_ROW + (SUB_ROW - SUB_BAR) / 2, SUB_BAR


def _draw_bars(w, lay: _Layout) -> None:
    """A bar per op with its tooltip, then their labels on top (a label never hides under the next bar)."""
    labels = []
    w('<g class="bars">')
    for b in sorted(lay.bars, key=lambda b: (b.rank, b.start)):
        label, fill = KIND_STYLE.get(b.kind, OTHER_STYLE)
        x = lay.x_of(b.start)
        bw = max(0.6, lay.plot_w * b.dur / lay.span)
        y0, bh = _bar_box(lay, b)
        tip = f"{b.name} · {label} · {_fmt_dur(b.dur)} at {b.start / 1000:.3f} ms"
        if b.bytes:
            tip += f" · {human_bytes(b.bytes)}"
        if lay.on_critical(b):
            stroke, sw = "#111111", 1.6
            tip += " · on the critical path"
        else:
            stroke, sw = "#ffffff", 0.5 if bw > 3 else 0
        w(f'<rect x="{x:.2f}" y="{y0:.1f}" width="{bw:.2f}" height="{bh}" fill="{fill}" '
          f'stroke="{stroke}" stroke-width="{sw}"><title>{escape(tip)}</title></rect>')
        # The name where it fits, else the unit number (the colour already says the kind).
        for text in (b.name, "" if b.unit is None else str(b.unit)):
            if text and bw >= len(text) * CHAR_W + 6:
                labels.append((x + bw / 2, y0 + bh / 2 + 3.5, text, _text_colour(fill)))
                break
    w('</g>')
    w('<g class="labels" text-anchor="middle" pointer-events="none">')
    for x, y0, text, colour in labels:
        w(f'<text x="{x:.1f}" y="{y0:.1f}" fill="{colour}">{escape(text)}</text>')
    w('</g>')


def _draw_memory(w, lay: _Layout) -> None:
    """One band per tier, each on its own scale (device MiB next to nvme GiB stays legible)."""
    if not lay.curves:
        return
    w(f'<text x="8" y="{lay.mem_top - 10:.1f}" font-size="12" font-weight="bold" fill="#1a1a1a">'
      f'memory held</text>')
    for i, tier in enumerate(lay.tiers):
        _draw_memory_band(w, lay, tier, lay.mem_top + (i + 1) * MEM_BAND + i * MEM_GAP)


def _draw_memory_band(w, lay: _Layout, tier: str, band_bottom: float) -> None:
    """One tier's band: its frame, scale and peak, and a step curve per rank group."""
    tier_pts = {r: pts for (r, t), pts in lay.curves.items() if t == tier}
    peak = max(v for pts in tier_pts.values() for _, v in pts)
    ymax = _nice_ceiling_bytes(peak)
    y_of = lambda v: band_bottom - (MEM_BAND - 4) * v / ymax  # noqa: E731
    colour = lay.colours[tier]
    w(f'<rect x="{LEFT}" y="{band_bottom - MEM_BAND:.1f}" width="{lay.plot_w}" height="{MEM_BAND}" '
      f'fill="none" stroke="#cccccc" stroke-width="0.5"/>')
    w(f'<line x1="{LEFT}" y1="{y_of(ymax):.1f}" x2="{WIDTH - RIGHT}" y2="{y_of(ymax):.1f}" '
      f'stroke="#eeeeee"/>')
    w(f'<text x="20" y="{band_bottom - MEM_BAND / 2 + 4:.1f}" font-size="11" fill="{colour}" '
      f'font-weight="bold">{escape(tier)}</text>')
    w(f'<text x="20" y="{band_bottom - MEM_BAND / 2 + 17:.1f}" fill="#777777">'
      f'peak {escape(human_bytes(peak))}</text>')
    w(f'<text x="{LEFT - 6}" y="{y_of(ymax) + 3.5:.1f}" text-anchor="end" fill="#555555">'
      f'{escape(human_bytes(ymax))}</text>')
    w(f'<text x="{LEFT - 6}" y="{band_bottom:.1f}" text-anchor="end" fill="#555555">0</text>')
    x_of = lay.x_of
    first_group = min(lay.rank_y, default=min(tier_pts))   # a trace of frees alone has no lanes drawn
    for rank, pts in sorted(tier_pts.items()):
        d = f"M{x_of(pts[0][0]):.1f},{y_of(pts[0][1]):.1f}" + "".join(
            f"H{x_of(t):.1f}V{y_of(v):.1f}" for t, v in pts[1:]) + f"H{x_of(lay.span):.1f}"
        first = rank == first_group
        if first:   # shade under the first rank's curve so the band reads as "held"
            w(f'<path d="{d}V{band_bottom:.1f}H{x_of(0):.1f}Z" fill="{colour}" '
              f'fill-opacity="0.12" stroke="none"/>')
        dash = "" if first else ' stroke-dasharray="5,3"'
        rpeak = max(v for _, v in pts)
        w(f'<path class="memory" data-tier="{escape(tier)}" data-source="{escape(lay.sources[rank[0]][0])}" '
          f'data-rank="{rank[1]}" d="{d}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}>'
          f'<title>{escape(f"{lay.group_label(rank)} {tier}: peak {human_bytes(rpeak)}")}</title></path>')


def _draw_legend(w, lay: _Layout) -> None:
    """Op kinds in rows of ``per_row``; with several rank groups, which memory line is which."""
    ly = lay.legend_top
    col_w = (WIDTH - LEFT - RIGHT) / lay.per_row
    for i, (label, fill) in enumerate(lay.legend_items):
        x = LEFT + (i % lay.per_row) * col_w
        yy = ly + (i // lay.per_row) * 18
        if fill == "outline":
            w(f'<rect x="{x:.1f}" y="{yy - 9}" width="14" height="11" fill="#ffffff" stroke="#111111" '
              f'stroke-width="1.6"/>')
        else:
            w(f'<rect x="{x:.1f}" y="{yy - 9}" width="14" height="11" fill="{fill}"/>')
        w(f'<text x="{x + 19:.1f}" y="{yy}" font-size="11" fill="#1a1a1a">{escape(label)}</text>')
    w(f'<text x="8" y="{ly}" font-size="11" fill="#555555">ops</text>')
    if not (lay.curves and len(lay.rank_y) > 1):
        return
    first = lay.group_label(min(lay.rank_y))
    yy = ly + 18 * lay.legend_rows
    w(f'<text x="8" y="{yy}" font-size="11" fill="#555555">memory</text>')
    w(f'<line x1="{LEFT}" y1="{yy - 4}" x2="{LEFT + 22}" y2="{yy - 4}" stroke="#555555" stroke-width="1.6"/>')
    w(f'<text x="{LEFT + 27}" y="{yy}" font-size="11" fill="#1a1a1a">{escape(first)}</text>')
    other_x = LEFT + 40 + len(first) * 6.4
    w(f'<line x1="{other_x:.1f}" y1="{yy - 4}" x2="{other_x + 22:.1f}" y2="{yy - 4}" stroke="#555555" '
      f'stroke-width="1.6" stroke-dasharray="5,3"/>')
    w(f'<text x="{other_x + 27:.1f}" y="{yy}" font-size="11" fill="#1a1a1a">'
      f'{"the others" if lay.compare else "other ranks"}</text>')


def render_svg(trace, title: str | None = None, step: int | None = None, compare=None,
               labels: tuple[str, str] = ("measured", "predicted"), critical=None) -> str:
    """The SVG text for one step of ``trace`` (see the module docstring for the format).

    ``compare``: a second trace (e.g. the planner's prediction) drawn under
    the first on the same time axis, its groups labelled ``labels[1]``.
    ``critical``: op ids to outline (``zdsl.observe.overlap``'s critical path), for
    every rank of the first trace, or a dict rank -> op ids.
    """
    sources = [(labels[0], trace, step)] + ([(labels[1], compare, None)] if compare is not None else [])
    lay = _layout(sources, compare is not None, critical)
    out: list[str] = []
    _draw_heading(out.append, lay, title)
    _draw_lanes(out.append, lay)
    _draw_time_axis(out.append, lay)
    _draw_bars(out.append, lay)
    _draw_memory(out.append, lay)
    _draw_legend(out.append, lay)
    out.append('</svg>')
    return "\n".join(out) + "\n"


def render_timeline(events, out_path, title: str | None = None, step: int | None = None,
                    compare=None, labels: tuple[str, str] = ("measured", "predicted"), critical=None) -> str:
    """Draw one step of a Chrome trace (dict or event list) into ``out_path`` as SVG.

    ``step`` picks the step when events carry ``args.step`` (default: the
    last one, past warm-up). ``compare``: a second trace drawn under the
    first on the same time axis (measured above, predicted below). Returns
    the path written. Raises :class:`TraceError` with a readable message for
    a trace it cannot draw. ``critical``: op ids to outline (see :func:`render_svg`).
    """
    svg = render_svg(events, title=title, step=step, compare=compare, labels=labels, critical=critical)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(svg)
    return str(out_path)


def _source_label(trace, default: str) -> str:
    """"measured" / "predicted" from the trace's metadata (``zdsl run`` / ``zdsl plan``)."""
    source = str((trace.get("metadata") or {}).get("source", "")) if isinstance(trace, dict) else ""
    return "predicted" if "predicted" in source else "measured" if "measured" in source else default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zdsl.observe.timeline",
                                     description="Draw one step of a Chrome trace as an SVG timeline.")
    parser.add_argument("trace", help="trace JSON written by `zdsl run --trace` or `zdsl plan --trace`")
    parser.add_argument("out", help="SVG file to write")
    parser.add_argument("--step", type=int, default=None, help="which step (default: the last)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--compare", metavar="OTHER.json", default=None,
                        help="a second trace (e.g. `zdsl plan --trace`) drawn below on the same time axis")
    args = parser.parse_args(argv)
    traces = []
    for path in [args.trace] + ([args.compare] if args.compare else []):
        try:
            with open(path, encoding="utf-8") as f:
                traces.append(json.load(f))
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
        except json.JSONDecodeError as e:
            print(f"error: {path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg})", file=sys.stderr)
            return 2
    names = [_source_label(t, d) for t, d in zip(traces, ("measured", "predicted"))] + [""]
    labels = (names[0], names[1])
    if labels[0] == labels[1]:
        labels = (labels[0], f"{labels[1]} ({os.path.basename(args.compare)})")
    try:
        path = render_timeline(traces[0], args.out, title=args.title, step=args.step,
                               compare=traces[1] if args.compare else None, labels=labels)
    except TraceError as e:
        print(f"error: {args.trace if not args.compare else 'the traces'}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
