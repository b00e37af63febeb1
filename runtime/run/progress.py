"""What a person watches during a run: a live line per step, a summary at the end."""
from __future__ import annotations

import statistics
import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zdsl.lang.sizes import human_bytes
from zdsl.runtime.run.train import StepMetrics, metrics_line


class Reporter:
    """Rank 0's view: progress lines (a live bar on a terminal), metrics JSONL, summary table."""

    def __init__(self, name: str, steps: int, metrics_path: str | None = None, show: bool = True):
        self.name, self.steps = name, steps
        self.console = Console(stderr=False)
        self.show = show
        self.history: list[StepMetrics] = []
        self.checkpoint_costs: list = []       # runtime.checkpointing.SaveCost, set by the loop
        self.metrics = open(metrics_path, "w") if metrics_path else None
        self.every = 1 if self.console.is_terminal else max(1, steps // 20)
        self.progress = None
        if show and self.console.is_terminal:
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                                     TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task(name, total=steps, info="")
            self.progress.start()

    def step(self, m: StepMetrics) -> None:
        self.history.append(m)
        if self.metrics:
            self.metrics.write(metrics_line(m) + "\n")
            self.metrics.flush()
        mem = max((p.get("device", 0) for p in m.peak_bytes.values()), default=0)
        host = max((p.get("host", 0) for p in m.peak_bytes.values()), default=0)
        info = (f"loss {m.loss:.4f}" + (f"  val_loss {m.val_loss:.4f}" if m.val_loss is not None else "")
                + (f"  lr {m.lr:.3g}" if m.lr is not None else "")
                + f"  {m.tokens_per_s:,.0f} tok/s  {m.step_s * 1000:.0f} ms"
                f"  device {human_bytes(mem)}  host {human_bytes(host)}"
                + ("  [overflow: step skipped]" if m.skipped else ""))
        if self.progress is not None:
            self.progress.update(self.task, advance=1, info=info)
        elif self.show and (m.step % self.every == 0 or m.step == self.steps - 1 or m.skipped
                            or m.val_loss is not None):
            print(f"step {m.step + 1}/{self.steps}  {info}", flush=True)

    def close(self, extra_rows: list[tuple[str, str]] | None = None, finished: bool = True) -> None:
        """End the display; the summary only for a run that finished (a failed one has its error),
        with ``--quiet`` one line of it."""
        if self.progress is not None:
            self.progress.stop()
        if self.metrics:
            self.metrics.close()
        if not finished or not self.history:
            return
        h = self.history
        timed = [m.step_s for m in h[1:]] or [h[0].step_s]
        evaluated = [m for m in h if m.val_loss is not None]
        if not self.show:
            val = f", val_loss {evaluated[-1].val_loss:.2f}" if evaluated else ""
            print(f"zdsl: {self.name}: {len(h)} steps, loss {h[0].loss:.2f} -> {h[-1].loss:.2f}{val}, "
                  f"median step {statistics.median(timed) * 1000:.0f} ms", flush=True)
            return
        table = Table(title=f"zdsl run: {self.name}", show_header=False)
        table.add_row("steps", str(len(h)))
        table.add_row("loss", f"{h[0].loss:.4f} -> {h[-1].loss:.4f}")
        if evaluated:
            first, last = evaluated[0], evaluated[-1]
            table.add_row("val_loss", f"{last.val_loss:.4f} after step {last.step + 1}" if first is last else
                          f"{first.val_loss:.4f} (step {first.step + 1}) -> {last.val_loss:.4f} (step {last.step + 1})")
        table.add_row("median step", f"{statistics.median(timed) * 1000:.1f} ms")
        table.add_row("tokens/s", f"{statistics.median(m.tokens_per_s for m in h[1:] or h):,.0f}")
        skipped = sum(m.skipped for m in h)
        if skipped:
            table.add_row("skipped steps (fp16 overflow)", str(skipped))
        for rank, peaks in sorted(h[-1].peak_bytes.items()):
            peak = {t: max(m.peak_bytes[rank].get(t, 0) for m in h) for t in peaks}
            table.add_row(f"rank {rank} peak", "  ".join(f"{t} {human_bytes(v)}" for t, v in peak.items() if v))
        shown = overlap_step(h)
        if shown is not None:
            # every figure from one step, each beside the time it belongs to (zdsl.observe.overlap: for one
            # rank, lower bound <= critical path <= its step)
            o = shown.overlap
            assert o is not None        # overlap_step picks a step that has them
            table.add_row(f"overlap (step {shown.step + 1})",
                          f"efficiency {o['overlap_efficiency']:.2f} of a {shown.step_s * 1000:.1f} ms step")
            r0 = o.get("rank0") or {}
            if r0:
                table.add_row("lane busy (rank 0)", "  ".join(
                    f"{lane} {share:.0%}" for lane, share in sorted(r0["lane_share"].items(), key=lambda kv: -kv[1])))
                kinds = sorted(r0["critical_path_by_kind_s"].items(), key=lambda kv: -kv[1])[:4]
                table.add_row("critical path (rank 0)",
                              f"{r0['critical_path_s'] * 1000:.1f} ms of its {r0['step_time_s'] * 1000:.1f} ms "
                              f"(lower bound {r0['lower_bound_s'] * 1000:.1f} ms): " + ", ".join(
                                  f"{k.split('.', 1)[1]} {v * 1000:.1f} ms" for k, v in kinds if v > 0))
        if self.checkpoint_costs:
            c = self.checkpoint_costs
            table.add_row("checkpoint saves", f"{len(c)} x {human_bytes(c[0].bytes)} per rank: training waited "
                          f"{statistics.median(x.blocking_s for x in c) * 1000:.1f} ms, writer "
                          f"{statistics.median(x.writing_s for x in c) * 1000:.1f} ms (median, overlapped)")
        for k, v in extra_rows or []:
            table.add_row(k, v)
        Console(file=sys.stdout).print(table)


def overlap_step(history: list[StepMetrics]) -> StepMetrics | None:
    """The step whose overlap figures the summary shows: the median step (by time) of those that
    have them (every step with --metrics, else only the last)."""
    with_overlap = sorted((m for m in history if m.overlap), key=lambda m: m.step_s)
    return with_overlap[(len(with_overlap) - 1) // 2] if with_overlap else None
