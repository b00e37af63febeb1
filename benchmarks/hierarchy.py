"""Hierarchical sharding (issue 57): flat ZeRO-3 against HSDP and hpZ, measured and planned.

    python benchmarks/hierarchy.py                       # 4 ranks as 2 nodes of 2, 20 MB/s across
    python benchmarks/hierarchy.py --cluster-only        # only the plan for 64 nodes of 8 H100
    python benchmarks/hierarchy.py --rate 5e7 --reps 3 --steps 8

**On this machine.** The same GPT at 4 CPU ranks (gloo), as 2 "nodes" of 2, under three schedules:
flat ZeRO-3 (every collective over all 4), HSDP (``shard ... over node``: gathers and
reduce-scatters within the node, one all-reduce of the node shard across) and hpZ (``zero 3`` +
``secondary parameters over node``: the backward's gathers within the node). The ranks share one
host, so crossing a node costs nothing by itself: ``ZDSL_SIM_NODES=2:RATE``
(runtime/dist/sim_nodes.py) makes a collective whose group spans both nodes complete its ring's
bytes / RATE later, queued per rank. That is a SIMULATION of a slow network between nodes, not
one. Rounds are interleaved (flat, HSDP, hpZ, flat, ...) so the host's drift falls on all three;
a form's step is the median of its rounds' median steps (warm-up left out).

Each is set against its plan: this machine's calibrated profile (``zdsl plan``'s, measured once if
none is cached) with ``cluster_link=RATE``, so the plan prices what crosses nodes as the simulation
delays it; the plan's bytes across nodes per step are printed beside.

**At cluster scale.** The plan's prediction (no run) for 64 nodes of 8 H100
(``programs/machines/dgx-h100.zs``: datasheet peaks) of a 7B and a 70B Llama-shaped GPT (Llama 2's
layers, width, heads, vocabulary; context 4096, bf16, batch 1 per rank, recompute): each form's
step, bytes per rank within and across nodes, and whether its peak fits the H100's 80 GB.

What a real cluster run would have to confirm: NCCL's achieved bus bandwidth within and across
nodes (the profile's are peaks), the overlap of the backward's collectives with compute at that
scale, and the compute rate of a 4096-wide block in bf16 (the plan uses the datasheet's).

Results: benchmarks/README.md (hierarchy)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.driver import compile_file            # noqa: E402
from zdsl.lang.sizes import human_bytes         # noqa: E402
from zdsl.planner.levels import bytes_by_level  # noqa: E402
from zdsl.sim import profile_cache              # noqa: E402
from zdsl.sim.simulate import simulate          # noqa: E402

FORMS = {"flat ZeRO-3": "zero 3", "HSDP": "shard optimizer, gradients, parameters over node",
         "hpZ": "zero 3\nsecondary parameters over node"}
CLUSTER_MODELS = {"7B": "layers=32, width=4096, heads=32, vocab=32000, context=4096",
                  "70B": "layers=80, width=8192, heads=64, vocab=32000, context=4096"}


def local_schedule(form: str, args) -> str:
    return (f"schedule hierarchy\nmodel gpt(layers={args.layers}, width={args.width}, heads=4, vocab=512, "
            f"context={args.context})\ndata synthetic(context={args.context}, vocab=512)\n"
            f"train steps={args.warmup + args.steps}, batch=2, precision=fp32\noptimizer adamw(lr=1e-3)\n"
            f"ranks 4 on cpu, 2 per node\n{FORMS[form]}\n")


def planned(path: Path, rate: float) -> tuple[float, dict]:
    """The step the plan predicts with this machine's profile and ``cluster_link=rate``, and the
    bytes a rank sends per level."""
    compiled = compile_file(str(path), None, simulate=False)
    if not compiled.ok:
        raise RuntimeError(f"{path.name}: {compiled.diagnostics[0].message}")
    profile = compiled.schedule.machine.with_fields(cluster_bandwidth=rate)
    return simulate(compiled.graph, profile).step_s, bytes_by_level(compiled.graph)


def measured(path: Path, rate: float, warmup: int, timeout: float) -> float:
    """One ``zdsl run`` under simulated nodes: the median step after ``warmup`` steps."""
    metrics = path.with_suffix(".jsonl")
    metrics.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["ZDSL_SIM_NODES"] = f"2:{rate:g}"
    done = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(path), "--metrics", str(metrics),
                           "--quiet"], capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"zdsl run {path.name} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["step_s"] for r in rows[warmup:])


def on_this_machine(args) -> None:
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="zdsl-hierarchy-"))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {form: folder / f"{form.split()[0].lower().replace('-', '')}.zs" for form in FORMS}
    for form, path in paths.items():
        path.write_text(local_schedule(form, args))
    profile_cache.enable()
    plans = {form: planned(path, args.rate) for form, path in paths.items()}
    print(f"4 ranks as 2 nodes of 2, a GPT of {args.layers} layers, width {args.width}, context {args.context}, "
          f"fp32; across nodes simulated at {args.rate:g} B/s (ZDSL_SIM_NODES=2:{args.rate:g})")
    print(f"  {profile_cache.rates_line() or 'rates: the default profile'}, cluster_link={args.rate:g}")
    rounds: dict[str, list[float]] = {form: [] for form in FORMS}
    for r in range(args.reps):
        for form, path in paths.items():
            rounds[form].append(measured(path, args.rate, args.warmup, args.job_timeout))
        print(f"  round {r + 1}: " + ", ".join(f"{f} {s[-1] * 1e3:.0f} ms" for f, s in rounds.items()), flush=True)
    flat = statistics.median(rounds["flat ZeRO-3"])
    print(f"{'form':<12} {'measured':>10} {'planned':>10} {'meas/plan':>10} {'vs flat':>8} {'across/step':>12} "
          f"{'within/step':>12}")
    for form, steps in rounds.items():
        step, (plan_s, levels) = statistics.median(steps), plans[form]
        print(f"{form:<12} {step * 1e3:>8.0f} ms {plan_s * 1e3:>7.0f} ms {step / plan_s:>10.2f} {step / flat:>8.2f} "
              f"{human_bytes(levels['across_nodes']):>12} {human_bytes(levels['within_node']):>12}")


def cluster_schedule(model: str, form: str) -> str:
    return (f"schedule cluster\nmodel gpt({CLUSTER_MODELS[model]})\ntrain batch=1, precision=bf16\n"
            f"ranks 512 on cuda, 8 per node\n{FORMS[form]}\nrecompute blocks\n"
            f"include \"{ROOT / 'programs' / 'machines' / 'dgx-h100.zs'}\"\n")


def at_cluster_scale(folder: Path) -> None:
    print("\nplanned, 64 nodes of 8 H100 (programs/machines/dgx-h100.zs: datasheet peaks), bf16, context 4096, "
          "batch 1 per rank, recompute")
    print(f"{'model':<5} {'form':<12} {'step':>9} {'tokens/s/GPU':>13} {'across/step':>12} {'within/step':>12} "
          f"{'device peak':>12}  fits 80 GB")
    for model in CLUSTER_MODELS:
        for form in FORMS:
            path = folder / f"cluster-{model}-{form.split()[0].lower().replace('-', '')}.zs"
            path.write_text(cluster_schedule(model, form))
            compiled = compile_file(str(path), None, simulate=True)
            if compiled.graph is None or compiled.sim is None:
                print(f"{model:<5} {form:<12} does not compile: {compiled.diagnostics[0].message}")
                continue
            levels, sim = bytes_by_level(compiled.graph), compiled.sim
            peak = sim.memory.to_json()["device"]["peak"]
            over = [d.message for d in compiled.diagnostics if d.severity == "error"]
            print(f"{model:<5} {form:<12} {sim.step_s:>7.2f} s {4096 / sim.step_s:>13.0f} "
                  f"{human_bytes(levels['across_nodes']):>12} {human_bytes(levels['within_node']):>12} "
                  f"{human_bytes(peak):>12}  {'yes' if not over else 'no'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2e7, help="bytes a second across simulated nodes (default 2e7)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not counted (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds of the three forms (default 3)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--job-timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    ap.add_argument("--cluster-only", action="store_true", help="only the plan at cluster scale (no runs)")
    ap.add_argument("--workdir", help="keep the schedules and metrics here")
    args = ap.parse_args(argv)
    if not args.cluster_only:
        on_this_machine(args)
    at_cluster_scale(Path(args.workdir or tempfile.mkdtemp(prefix="zdsl-hierarchy-")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
