"""zdsl against its peers: the same model, the same steps, at 2 ranks on gloo.

    python benchmarks/vs_peers.py                      # every peer, on equal terms and as they come
    python benchmarks/vs_peers.py --peers ddp,fsdp2,zdsl3 --steps 8 --reps 3 --json out.json
    python benchmarks/vs_peers.py --terms equal        # only the equal-terms table
    python benchmarks/vs_peers.py --model hf:llama     # an HF Llama: zdsl stage 3, FSDP2, DeepSpeed ZeRO-3

Models: zdsl's built-in GPT (``--model gpt``), or a transformers
``LlamaForCausalLM`` (``--model hf:llama``, about 25M parameters by default)
saved once with ``save_pretrained`` from a seeded init into the work folder,
which zdsl reads as ``model hf("DIR")`` and the torch peers load with
``from_pretrained``.

Terms (``--terms``, both by default, interleaved): **equal**, every peer's
ranks bound to their share of the cores (``--bind cores``, the default: zdsl's
own binding, which is DeepSpeed's ``--bind_cores_to_rank`` and ``taskset`` for
torch's ranks; ``--bind none``: all unbound) and gloo's event-loop threads
under zdsl's policy (``ZDSL_GLOO_LOOP_POLICY``, applied by
``affinity.calm_gloo_loops`` in the torch and DeepSpeed ranks once their groups
exist); **as-they-come**, zdsl with its defaults (bound, its loop policy), DDP,
FSDP2 and DeepSpeed with theirs (unbound, the OS's policy). A zdsl job is the
same in both where ``--bind cores``, so it runs once a repetition and counts
in both tables. Every rank records the cores and loop policy it ended with,
and the table says them.

Peers: torch DDP, torch FSDP2 (``fully_shard`` per block, then the root),
DeepSpeed ZeRO-3 and ZeRO-2 (``DS_ACCELERATOR=cpu``; optional, installed by
``benchmarks/setup_peers.sh``), and zdsl stages 1, 2 and 3 through its own
CLI (``zdsl run FILE --set zero=N --metrics OUT``), and zdsl stage 3 trained through
``zdsl.initialize`` in a user loop under torchrun (``zdsl3-api``). Each is its own 2-process
job with the same init seed, the same batches (zdsl's data source), AdamW in
fp32 and one intra-op thread per rank. Repetitions are interleaved
(A B C A B C ...) so drift of a shared machine falls on every peer alike.

Per peer and terms it prints the median step time over the measured steps of every
repetition (warm-up steps left out; a step's time is the slowest rank's), the
median CPU seconds of a step's busiest rank (user + system, every thread: on a
shared machine it moves less than the wall time), the peak RSS of the
largest rank, step time and peak RSS each also as a ratio to the baseline
(zdsl stage 3 by default), the final loss, and the largest difference of the
per-step loss from DDP's, or FSDP2's where DDP is not in the run (they train
the same thing, so it should be small: bitwise zero for none of them is
promised, ~1e-5 is float noise).
A peer that cannot run here (DeepSpeed not installed, zdsl's ``run`` not
available) is a row that says why, never a made-up number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import BINDINGS, MODELS, TERMS, BenchConfig, job_env, run_bounded  # noqa: E402
from benchmarks.peers import zdsl_peer  # noqa: E402


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    module: str                     # benchmarks.peers.<module>, run under torchrun (or zdsl's CLI)
    extra: dict = field(default_factory=dict)

    @property
    def is_zdsl(self) -> bool:
        return self.module == "zdsl_peer"

    @property
    def is_zdsl_api(self) -> bool:       # zdsl's schedule in a user loop under torchrun: zdsl's defaults
        return self.module == "zdsl_api_peer"

    @property
    def is_deepspeed(self) -> bool:
        return self.module == "deepspeed_peer"


HF_PEERS = ("fsdp2", "ds3", "zdsl3")   # an HF model's comparison: ZeRO-3 against ZeRO-3

PEERS = {p.key: p for p in [
    Peer("ddp", "torch DDP", "ddp_peer"),
    Peer("fsdp2", "torch FSDP2", "fsdp2_peer"),
    Peer("ds3", "DeepSpeed ZeRO-3", "deepspeed_peer", {"stage": 3}),
    Peer("ds2", "DeepSpeed ZeRO-2", "deepspeed_peer", {"stage": 2}),
    Peer("zdsl1", "zdsl stage 1", "zdsl_peer", {"stage": 1}),
    Peer("zdsl2", "zdsl stage 2", "zdsl_peer", {"stage": 2}),
    Peer("zdsl3", "zdsl stage 3", "zdsl_peer", {"stage": 3}),
    Peer("zdsl3-api", "zdsl stage 3, own loop", "zdsl_api_peer", {"stage": 3}),   # zdsl.initialize
]}


@dataclass
class Outcome:
    """What one peer gave over all repetitions."""
    peer: Peer
    unavailable: str | None = None
    failed: str | None = None
    step_s: list[float] = field(default_factory=list)    # measured steps, every repetition
    peak_rss: list[int] = field(default_factory=list)    # one per repetition (largest rank)
    loss: list[float] | None = None                      # per step (all steps), mean over ranks
    cpu_s: list[float] = field(default_factory=list)     # measured steps: CPU s of the busiest rank
    ran_with: list[str] = field(default_factory=list)    # one per repetition: cores and loop policy
    info: dict = field(default_factory=dict)
    exits_after_results: list[str] = field(default_factory=list)   # measured, then failed to end cleanly

    @property
    def ok(self) -> bool:
        return not self.unavailable and not self.failed and bool(self.step_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def peak(self) -> int:
        return max(self.peak_rss)


# -- availability -----------------------------------------------------------------

def deepspeed_missing(cfg: BenchConfig) -> str | None:
    """Why ``import deepspeed`` fails here (its own last line), or None."""
    try:
        probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                               env=job_env(cfg), timeout=300)
    except subprocess.TimeoutExpired:
        return "import deepspeed did not finish in 300 s"
    if probe.returncode == 0:
        return None
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    why = lines[-1] if lines else f"exit {probe.returncode}"
    return f"import deepspeed failed ({why}); install with benchmarks/setup_peers.sh"


def check_availability(outcomes: dict[str, Outcome], cfg: BenchConfig, workdir: Path) -> None:
    if any(o.peer.is_deepspeed for o in outcomes.values()):
        why = deepspeed_missing(cfg)
        for o in outcomes.values():
            if o.peer.is_deepspeed:
                o.unavailable = why
    if any(o.peer.is_zdsl for o in outcomes.values()):
        why = zdsl_peer.availability(cfg, workdir)
        for o in outcomes.values():
            if o.peer.is_zdsl:
                o.unavailable = why


# -- one job ----------------------------------------------------------------------

def job_command(peer: Peer, config_path: Path, out: Path, timeout_s: float) -> list[str]:
    if peer.is_zdsl:
        return [sys.executable, "-m", "benchmarks.peers.zdsl_peer", "--config", str(config_path),
                "--stage", str(peer.extra["stage"]), "--out", str(out), "--timeout", str(timeout_s)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", f"benchmarks.peers.{peer.module}", "--config", str(config_path), "--out", str(out)]


def job_config(peer: Peer, cfg: BenchConfig, terms: str, policy: str) -> BenchConfig:
    """What one peer's job runs with under ``terms``: on equal terms ``cfg.bind`` and zdsl's loop
    ``policy`` for every peer; as they come, zdsl with its defaults (bound, its policy) and the
    others with theirs (unbound, the policy left to the OS)."""
    job = BenchConfig.from_json(cfg.to_json())
    job.extra = {**cfg.extra, **peer.extra}
    if terms == "equal":
        job.loop_policy = policy
    elif peer.is_zdsl or peer.is_zdsl_api:
        job.bind, job.loop_policy = "cores", policy
    else:
        job.bind, job.loop_policy = "none", ""
    return job


def run_job(peer: Peer, job_cfg: BenchConfig, out: Path, timeout_s: float) -> list[dict] | str:
    """Run one repetition of one peer in folder ``out``; its per-rank results, or why it failed."""
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(job_cfg.to_json())
    log = out / "job.log"
    with open(log, "w") as sink:
        code = run_bounded(job_command(peer, config_path, out, timeout_s), timeout_s + 30, cwd=REPO,
                           env=job_env(job_cfg), stdout=sink, stderr=subprocess.STDOUT)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    complete = bool(results) and len(results) == results[0]["world"]
    if code is None or not complete:
        ended = "timed out" if code is None else f"exited {code}"
        return f"{ended}; see {log}: {_tail_reason(log)}"
    if code != 0:    # every rank wrote its results, then the job died on the way out (seen: DeepSpeed's)
        results[0]["exit_after_results"] = f"exited {code} after every rank wrote its results: {_tail_reason(log)}"
    return results


def _tail_reason(log: Path) -> str:
    """The most telling line at the end of a job's log (an error line if there is one)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines[-60:]):
        if "Error" in line or "error:" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(empty log)"


def absorb(outcome: Outcome, ranks: list[dict]) -> None:
    """Fold one repetition's per-rank results into the peer's outcome."""
    warmup = ranks[0]["warmup"]
    steps = len(ranks[0]["step_s"])
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    outcome.step_s.extend(slowest[warmup:])
    if all(r.get("cpu_s") for r in ranks):       # None: a step whose CPU time is not known
        outcome.cpu_s.extend(max(r["cpu_s"][i] for r in ranks) for i in range(warmup, steps)
                             if all(r["cpu_s"][i] is not None for r in ranks))
    outcome.ran_with.append(describe_ran_with(ranks))
    outcome.peak_rss.append(max(r["peak_rss"] for r in ranks))
    loss = [statistics.fmean(r["loss"][i] for r in ranks) for i in range(steps)]
    outcome.loss = outcome.loss or loss
    if ranks[0].get("exit_after_results"):
        outcome.exits_after_results.append(ranks[0]["exit_after_results"])
    outcome.info = {**ranks[0].get("info", {}), "zdsl_peak_bytes": ranks[0].get("zdsl_peak_bytes")} \
        if ranks[0].get("zdsl_peak_bytes") else ranks[0].get("info", {})


def describe_ran_with(ranks: list[dict]) -> str:
    """"cores 0|1, loops batch" or "unbound, loops normal": what a job's ranks recorded."""
    records = [r["ran_with"] for r in ranks if r.get("ran_with")]
    if not records:
        return "?"
    cores, policies = [], {}
    for rec in records:     # a torch rank records its own cores; zdsl's one row, every rank's
        per_rank = rec["cores"] if rec["cores"] and isinstance(rec["cores"][0], list) else [rec["cores"]]
        cores.extend(per_rank if rec["bound"] else [])
        for name, count in rec["loop_policy"].items():
            policies[name] = policies.get(name, 0) + count
    where = ("cores " + "|".join(",".join(map(str, c)) for c in cores)) if cores else "unbound"
    loops = "+".join(sorted(policies)) or "none seen"
    return f"{where}, loops {loops}"


# -- the table --------------------------------------------------------------------

def max_loss_diff(a: list[float] | None, b: list[float] | None) -> float | None:
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


LOSS_REFERENCES = ("ddp", "fsdp2")   # whose per-step loss the others are compared with: the first that ran


def loss_reference(outcomes: dict[str, Outcome]) -> str | None:
    return next((k for k in LOSS_REFERENCES if k in outcomes and outcomes[k].ok), None)


def summary(outcomes: dict[str, Outcome], baseline: str) -> list[dict]:
    base = outcomes.get(baseline)
    base = base if base and base.ok else None
    ref = loss_reference(outcomes)
    ref_loss = outcomes[ref].loss if ref else None
    rows = []
    for key, o in outcomes.items():
        row = dict(peer=key, system=o.peer.label)
        if not o.ok:
            row["status"] = f"unavailable: {o.unavailable}" if o.unavailable else f"failed: {o.failed}"
            rows.append(row)
            continue
        row.update(status="ok", median_step_s=o.median_s, min_step_s=min(o.step_s), steps_measured=len(o.step_s),
                   median_cpu_s=statistics.median(o.cpu_s) if o.cpu_s else None,
                   ran_with=" / ".join(dict.fromkeys(o.ran_with)),
                   peak_rss_mib=o.peak / 2**20, final_loss=o.loss[-1] if o.loss else None,
                   loss_diff_vs_ref=max_loss_diff(o.loss, ref_loss), loss_reference=ref, loss=o.loss,
                   step_s=o.step_s, exits_after_results=o.exits_after_results,
                   info=o.info)
        if base:
            row["time_ratio"] = o.median_s / base.median_s
            row["memory_ratio"] = o.peak / base.peak
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], baseline: str, out=sys.stdout, *, second: list[dict] | None = None,
                second_label: str = "as they come") -> None:
    """The table of ``rows``; with ``second`` (the same peers under other terms), its median
    step, its time ratio to the baseline and what each ran with, as three more columns."""
    ref = next((r["loss_reference"] for r in rows if r.get("loss_reference")), None)
    ref_label = {"ddp": "DDP", "fsdp2": "FSDP2"}.get(ref, "-")
    head = ("system", "median step s", "min step s", "CPU s", "peak RSS MiB", f"time / {baseline}", f"mem / {baseline}",
            "final loss", f"max |loss - {ref_label}|", "ran with")
    if second is not None:
        head += (f"{second_label}: step s", f"time / {baseline}", "ran with")
    other = {r["peer"]: r for r in second or []}
    body = []
    notes = []
    for r in rows:
        if r["status"] != "ok":
            notes.append(f"{r['system']}: {r['status']}")
            line = (r["system"], r["status"].split(":")[0], "", "", "", "", "", "", "", "")
        else:
            line = (r["system"], _fmt(r["median_step_s"], ".3f"), _fmt(r["min_step_s"], ".3f"),
                    _fmt(r["median_cpu_s"], ".3f"), _fmt(r["peak_rss_mib"], ".0f"),
                    _fmt(r.get("time_ratio"), ".2f"), _fmt(r.get("memory_ratio"), ".2f"),
                    _fmt(r["final_loss"], ".4f"), _fmt(r["loss_diff_vs_ref"], ".2e"), r["ran_with"])
        if second is not None:
            s2 = other.get(r["peer"])
            if s2 is None or s2["status"] != "ok":
                if s2 is not None and s2["status"] != "ok":
                    notes.append(f"{r['system']} ({second_label}): {s2['status']}")
                line += ("-" if s2 is None else s2["status"].split(":")[0], "", "")
            else:
                line += (_fmt(s2["median_step_s"], ".3f"), _fmt(s2.get("time_ratio"), ".2f"), s2["ran_with"])
        body.append(line)
    widths = [max(len(str(line[i])) for line in [head, *body]) for i in range(len(head))]
    left = {0} | {i for i, h in enumerate(head) if h == "ran with"}     # text columns; numbers go right
    for line in [head, tuple("-" * w for w in widths), *body]:
        print("  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths))).rstrip(), file=out)
    for r in [*rows, *(second or [])]:
        for exit_note in r.get("exits_after_results", []):
            notes.append(f"{r['system']}: a repetition {exit_note}")
    for note in dict.fromkeys(notes):
        print("  " + note, file=out)
    if not any(r["peer"] == baseline and r["status"] == "ok" for r in rows):
        print(f"  ratios: n/a (the baseline {baseline} did not run; pick another with --baseline)", file=out)
    for r in rows:
        if r["status"] == "ok" and r.get("info", {}).get("optimizer"):
            print(f"  {r['system']}: {r['info'].get('wrapper', '')}; optimizer {r['info']['optimizer']}",
                  file=out)


TARGETS = {   # model -> (zdsl row, peer row, target ratio of step times): the goals, on equal terms
    "gpt": [("zdsl3", "fsdp2", 0.7), ("zdsl3", "ds3", 0.7),          # with the peers bound alike
            ("zdsl1", "ddp", 0.9), ("zdsl2", "ddp", 0.9)],
    "hf:llama": [("zdsl3", "fsdp2", 0.8), ("zdsl3", "ds3", 0.8)],    # the same HF model, 20% faster
}


def target_lines(rows: list[dict], model: str = "gpt", judged: bool = True) -> list[str]:
    """zdsl's step time over each peer's, against the target (or, not ``judged``, beside it),
    for the rows that ran."""
    by_key = {r["peer"]: r for r in rows if r["status"] == "ok"}
    lines = []
    for ours, theirs, target in TARGETS[model]:
        if ours in by_key and theirs in by_key:
            ratio = by_key[ours]["median_step_s"] / by_key[theirs]["median_step_s"]
            verdict = f": {'met' if ratio <= target else 'not met'}" if judged else ", set on equal terms"
            lines.append(f"  {by_key[ours]['system']} / {by_key[theirs]['system']} step time: {ratio:.2f} "
                         f"(target <= {target:.1f}{verdict})")
    return lines


# -- command line -----------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="zdsl against torch DDP, FSDP2 and DeepSpeed: same model, 2 ranks, gloo.")
    p.add_argument("--model", choices=MODELS, default="gpt",
                   help="zdsl's built-in GPT, or a transformers Llama saved once and loaded by every peer")
    p.add_argument("--peers", help=f"comma list of {', '.join(PEERS)} (default: all; with --model hf:llama "
                                   f"{','.join(HF_PEERS)})")
    p.add_argument("--terms", default=",".join(TERMS),
                   help="comma list of equal (every peer with the same binding and zdsl's gloo loop policy) "
                        "and as-they-come (zdsl with its defaults, the others with theirs); default both, "
                        "interleaved: the equal-terms table with the as-they-come ratios beside it")
    p.add_argument("--bind", choices=BINDINGS, default="cores",
                   help="on equal terms, cores: every peer's ranks each on its own share of the cores "
                        "(default); none: all unbound")
    p.add_argument("--steps", type=int, default=8, help="measured steps per repetition (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not timed (default 2)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every peer (default 2)")
    p.add_argument("--layers", type=int, help="default 6 (gpt), 8 (hf:llama)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", choices=("synthetic", "stdlib"), default="synthetic",
                   help="zdsl's synthetic(...) streams or corpus(\"stdlib\") (default synthetic)")
    p.add_argument("--ds-optimizer", choices=("auto", "cpuadam", "torch"), default="auto",
                   help="DeepSpeed's client optimizer: DeepSpeedCPUAdam if it builds (auto), or torch AdamW")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072, metavar="BYTES",
                   help="fix glibc's mmap threshold in every job (MALLOC_MMAP_THRESHOLD_) so freed tensors "
                        "leave the RSS and peak RSS follows what each system holds (default 131072; "
                        "0 leaves glibc's dynamic threshold)")
    p.add_argument("--baseline", default="zdsl3", help="peer the ratios are taken against (default zdsl3)")
    p.add_argument("--job-timeout", type=float, default=540.0, help="seconds one job may take (default 540)")
    p.add_argument("--workdir", help="keep job folders (configs, logs, per-rank results) here")
    p.add_argument("--json", metavar="OUT", help="write the table and every measurement as JSON")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 8 if args.model == "hf:llama" else 6
    if args.peers is None:
        args.peers = ",".join(HF_PEERS if args.model == "hf:llama" else PEERS)
    keys = [k.strip() for k in args.peers.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PEERS]
    if unknown or not keys:
        p.error(f"unknown peer(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PEERS)}")
    if args.baseline not in PEERS:
        p.error(f"--baseline {args.baseline!r} is not a peer; choose from {', '.join(PEERS)}")
    for name in ("steps", "reps", "layers", "width", "heads", "vocab", "context", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.malloc_mmap_threshold < 0:
        p.error("--malloc-mmap-threshold must be 0 (glibc default) or a byte count")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    args.peer_keys = list(dict.fromkeys(keys))
    terms = [t.strip() for t in args.terms.split(",") if t.strip()]
    if not terms or any(t not in TERMS for t in terms):
        p.error(f"--terms {args.terms!r}: a comma list of {', '.join(TERMS)}")
    args.terms = [t for t in TERMS if t in terms]       # equal first: it is the table
    from zdsl.runtime.dist.affinity import loop_policy_error
    if loop_policy_error():
        p.error(loop_policy_error())
    return args


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("vs_peers.py: interrupted", file=sys.stderr)
        return 130


def prepare_model(cfg: BenchConfig, workdir: Path) -> int:
    """Make what every peer loads (the HF folder) and say what the model is; its parameter count."""
    if cfg.model == "hf:llama":
        from benchmarks.peers import hf_llama
        cfg.hf_dir = str(workdir / "llama")
        params = hf_llama.save_folder(cfg, Path(cfg.hf_dir))
        kw = hf_llama.config_kwargs(cfg)
        print(f"HF Llama layers={cfg.layers} width={cfg.width} heads={cfg.heads} "
              f"intermediate={kw['intermediate_size']} vocab={cfg.vocab} context={cfg.context}: "
              f"{params:,} parameters ({params / 1e6:.1f}M), saved to {cfg.hf_dir}")
        return params
    from zdsl.model.units import gpt_parameter_count
    params = gpt_parameter_count(**cfg.model_kwargs())
    print(f"GPT layers={cfg.layers} width={cfg.width} heads={cfg.heads} vocab={cfg.vocab} "
          f"context={cfg.context}: {params:,} parameters ({params / 1e6:.1f}M)")
    return params


def _main(argv=None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab,
                      context=args.context, batch=args.batch, steps=args.steps, warmup=args.warmup,
                      seed=args.seed, data=args.data, lr=args.lr, model=args.model, bind=args.bind,
                      extra={"ds_optimizer": args.ds_optimizer})
    if args.malloc_mmap_threshold > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)   # inherited by every job
    try:
        workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vs_peers-"))
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"vs_peers.py: error: cannot use --workdir {args.workdir}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        params = prepare_model(cfg, workdir)
    except ImportError as exc:
        print(f"vs_peers.py: error: --model {cfg.model} needs {exc.name or exc}; "
              "install it with benchmarks/setup_peers.sh", file=sys.stderr)
        return 2
    from zdsl import env
    policy = env.get("ZDSL_GLOO_LOOP_POLICY")
    said = {"equal": f"every peer's ranks {'bound to their cores' if cfg.bind == 'cores' else 'unbound'}, "
                     f"gloo loops {policy}",
            "as-they-come": f"zdsl bound, gloo loops {policy}; the others unbound, loops as the OS has them"}
    print(f"2 ranks on gloo, batch {cfg.batch} per rank, AdamW fp32, {cfg.warmup} warm-up + {cfg.steps} "
          f"measured steps, {args.reps} interleaved repetitions, data {cfg.data}, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'glibc default')}; "
          + "; ".join(f"{t}: {said[t]}" for t in args.terms), flush=True)
    tables = {t: {k: Outcome(PEERS[k]) for k in args.peer_keys} for t in args.terms}
    check_availability(tables[args.terms[0]], cfg, workdir)
    for outcomes in tables.values():
        for key, o in outcomes.items():
            o.unavailable = tables[args.terms[0]][key].unavailable
    for rep in range(args.reps):
        ran: dict[str, tuple[str, list[dict] | str]] = {}   # this repetition's jobs by what they ran with
        for key in args.peer_keys:          # one peer's terms side by side: they see the same machine
            for terms in args.terms:
                o = tables[terms][key]
                if o.unavailable or o.failed:
                    continue
                job = job_config(o.peer, cfg, terms, policy)
                same = f"{key}\n{job.to_json()}"
                if same in ran:             # zdsl bound is zdsl as it comes: one job counts for both
                    where, got = ran[same]
                    took = None
                else:
                    started = time.monotonic()
                    where = f"{key}.{terms}.rep{rep}"
                    got = run_job(o.peer, job, workdir / where, args.job_timeout)
                    took = time.monotonic() - started
                    ran[same] = (where, got)
                tag = f"[rep {rep + 1}/{args.reps}] {key} ({terms})"
                if isinstance(got, str):
                    o.failed = got
                    print(f"{tag}: failed ({got})", file=sys.stderr, flush=True)
                    continue
                absorb(o, got)
                print(f"{tag}: median so far {o.median_s:.3f} s, peak RSS {o.peak / 2**20:.0f} MiB, "
                      + (f"job {took:.0f} s" if took is not None else f"the job of {where}"),
                      file=sys.stderr, flush=True)

    rows = {t: summary(outcomes, args.baseline) for t, outcomes in tables.items()}
    first = args.terms[0]
    print()
    print(f"{'On equal terms' if first == 'equal' else 'As they come'} ({said[first]})"
          + (f"; beside it, as they come ({said['as-they-come']})" if len(args.terms) > 1 else "") + ":")
    print_table(rows[first], args.baseline, second=rows.get("as-they-come") if len(args.terms) > 1 else None)
    targets = {t: target_lines(rows[t], cfg.model, judged=(t == "equal")) for t in args.terms}
    for t in args.terms:
        if targets[t] and len(args.terms) > 1:
            print(f"{t}:")
        for line in targets[t]:
            print(line)
    print(f"(job folders: {workdir})")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(dict(parameters=params, config=json.loads(cfg.to_json()),
                                                       reps=args.reps, baseline=args.baseline,
                                                       malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                                                       loop_policy=policy, terms=args.terms,
                                                       rows=rows[first], tables=rows,
                                                       targets={t: [x.strip() for x in targets[t]]
                                                                for t in args.terms}),
                                                  indent=1))
        except OSError as exc:
            print(f"vs_peers.py: error: cannot write --json {args.json}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0 if all(r["status"] == "ok" or r["status"].startswith("unavailable")
                    for table in rows.values() for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
