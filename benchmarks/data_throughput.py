"""What ``data tokens("FILE")`` costs: tokens/s from a 1 GiB token file against a plain numpy memmap loop,
and its share of a training step at the quickstart and vs_peers sizes.

    python benchmarks/data_throughput.py                   # 1 GiB uint16 file in a temp folder, deleted after
    python benchmarks/data_throughput.py --size 256MiB --folder /scratch --calls 500 --repeat 5

The file (random ids below 50304, GPT-2's padded vocab) is written in 64 MiB chunks. Then:

- the one-time check (every id below the vocab): the first scan, then the cached verdict;
- tokens/s of one rank's micro-batch, ``zdsl.runtime.data.make_batch`` (the path a rank runs:
  sample keys, window starts, memmap windows, int64 ``(idx, targets)`` tensors), against
  nanoGPT's ``get_batch`` over ``np.memmap`` with the same starts; warm (the file in the page
  cache, as right after writing it) and cold (its pages dropped with ``posix_fadvise`` before each
  repeat, so every window is read from disk). Best of ``--repeat``, ours and the loop interleaved;
- the share of a step: one rank's data time per optimizer step (``batch * accumulate`` windows,
  a sleep of one step between steps, median over the steps after the first, which is shown apart)
  over the median ``step_s`` that ``zdsl run --metrics`` measured for programs/quickstart.zs and
  for the vs_peers GPT (benchmarks/peers BenchConfig: 6 x 512, context 256, batch 1), both at 2
  ranks, warm-up steps left out. Target: <= 2%.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from zdsl.runtime.data import make_batch
from zdsl.runtime.data.keys import sample_keys
from zdsl.runtime.data import tokens as tokens_module
from zdsl.runtime.data.tokens import check_token_file
from zdsl.schedule import DataSpec

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "programs" / "quickstart.zs"
VOCAB = 50304
CHUNK = 64 << 20
# (name, batch per rank, accumulate, context): the sizes whose steps are measured below.
SIZES = [("quickstart", 4, 1, 32), ("vs_peers", 1, 1, 256), ("nanoGPT 124M", 12, 1, 1024)]


def size_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def write_file(path: Path, size: int) -> float:
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = size // 2
        while left:
            n = min(left, CHUNK // 2)
            f.write(rng.integers(0, VOCAB, n, dtype=np.uint16).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())                 # dirty pages cannot be dropped: the first check reads from disk
    return time.perf_counter() - start


def drop_pages(path: Path) -> None:
    """Evict the file from the page cache; pages still mapped stay, so the runtime's memmap goes first."""
    tokens_module._open.cache_clear()
    gc.collect()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ours(spec: DataSpec, calls: int, batch: int) -> None:
    for step in range(calls):
        make_batch(spec, 0, step, 0, 0, 2, batch)


def numpy_loop(path: Path, calls: int, batch: int, context: int) -> None:
    """nanoGPT's get_batch over np.memmap, with zdsl's window starts."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    for step in range(calls):
        keys = sample_keys(0, step, 0, 0, batch)
        ix = (keys % np.uint64(len(data) - context)).astype(np.int64)
        x = torch.from_numpy(np.stack([data[i:i + context].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + context].astype(np.int64) for i in ix]))
        del x, y


def timed(run, path: Path, cold: bool) -> float:
    if cold:
        drop_pages(path)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measured_step_s(schedule: Path, steps: int, warmup: int) -> float | None:
    """Median step_s of ``zdsl run --metrics`` after ``warmup`` steps; None if the run fails."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        command = [sys.executable, "-m", "zdsl.cli", "run", str(schedule), "--quiet", "--metrics", str(metrics),
                   "--set", f"steps={steps + warmup}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  zdsl run {schedule.name} failed: {proc.stderr.strip()[-300:]}")
            return None
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(m["step_s"] for m in lines[warmup:])


def vs_peers_schedule(folder: Path) -> Path:
    text = QUICK.read_text()
    text = text.replace("gpt(layers=2, width=64, heads=4, vocab=256, context=32)",
                        "gpt(layers=6, width=512, heads=8, vocab=256, context=256)")
    text = text.replace('corpus("stdlib", context=32)', 'synthetic(context=256)')
    text = text.replace("batch=4", "batch=1")
    path = folder / "vs_peers_size.zs"
    path.write_text(text)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB", help="token file size (default 1GiB)")
    p.add_argument("--folder", default=None, help="where the file goes (default: a temp folder)")
    p.add_argument("--calls", type=int, default=300, help="micro-batches per timing (default 300)")
    p.add_argument("--repeat", type=int, default=3, help="timings per candidate, best kept (default 3)")
    p.add_argument("--no-steps", action="store_true", help="skip measuring the step times with zdsl run")
    p.add_argument("--share-steps", type=int, default=30, help="steps timed for the share of a step (default 30)")
    args = p.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        path = Path(tmp) / "train.bin"
        size = size_bytes(args.size) // 2 * 2
        seconds = write_file(path, size)
        print(f"token file: {size / 2**30:.2f} GiB, {size // 2:,} uint16 tokens, written in {seconds:.1f} s")

        drop_pages(path)
        start = time.perf_counter()
        check_token_file(str(path), "uint16", VOCAB)
        first = time.perf_counter() - start
        start = time.perf_counter()
        check_token_file(str(path), "uint16", VOCAB)
        cached = time.perf_counter() - start
        print(f"check: first scan (from disk) {first:.2f} s ({size / first / 2**30:.2f} GiB/s), "
              f"cached {cached * 1e3:.2f} ms")

        rows = []
        for name, batch, accumulate, context in SIZES:
            spec = DataSpec("tokens", str(path), {"context": context, "vocab": VOCAB}, "uint16")
            make_batch(spec, 0, 0, 0, 0, 2, batch)          # opens the memmap and reads the verdict once
            for cold in (False, True):
                times_ours, times_loop = [], []
                for _ in range(args.repeat):                # interleaved, so load falls on both alike
                    times_ours.append(timed(lambda: ours(spec, args.calls, batch), path, cold))
                    times_loop.append(timed(lambda: numpy_loop(path, args.calls, batch, context), path, cold))
                t_ours, t_loop = min(times_ours), min(times_loop)
                tokens = args.calls * batch * context
                rows.append((name, batch, accumulate, context, "cold" if cold else "warm",
                             tokens / t_ours, tokens / t_loop, t_ours / args.calls))

        print(f"\n{'size':<14}{'batch':>6}{'context':>8}  {'cache':<5}{'ours tok/s':>13}{'numpy tok/s':>13}"
              f"{'ours/numpy':>11}{'ms/micro':>10}")
        for name, batch, _, context, cache, ours_rate, loop_rate, per in rows:
            print(f"{name:<14}{batch:>6}{context:>8}  {cache:<5}{ours_rate:>13,.0f}{loop_rate:>13,.0f}"
                  f"{ours_rate / loop_rate:>11.2f}{per * 1e3:>10.3f}")

        if args.no_steps:
            return
        print("\nstep times: zdsl run --metrics, 2 ranks, median step_s after 2 warm-up steps")
        steps = {"quickstart": measured_step_s(QUICK, 10, 2),
                 "vs_peers": measured_step_s(vs_peers_schedule(Path(tmp)), 4, 2)}
        print(f"{'size':<14}{'cache':<6}{'step ms':>9}{'first ms':>10}{'data ms':>9}{'share':>9}   (data: "
              f"median over the {args.share_steps} steps after the first; target <= 2%)")
        for name, batch, accumulate, context in SIZES:
            step = steps.get(name)
            if step is None:
                continue
            spec = DataSpec("tokens", str(path), {"context": context, "vocab": VOCAB}, "uint16")
            for cold in (False, True):
                first, *rest = data_times(spec, batch, accumulate, step, args.share_steps + 1, path, cold)
                per = statistics.median(rest)
                print(f"{name:<14}{'cold' if cold else 'warm':<6}{step * 1e3:>9.1f}{first * 1e3:>10.3f}"
                      f"{per * 1e3:>9.3f}{per / step:>9.3%}")


def data_times(spec, batch: int, accumulate: int, step_s: float, steps: int, path: Path,
               cold: bool) -> list[float]:
    """The time a rank's data path takes in each optimizer step, with the step's compute (a sleep)
    in between, so the read-ahead of the next step's windows has the time it has in training."""
    if cold:
        drop_pages(path)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for micro in range(accumulate):
            make_batch(spec, 1, step, micro, 0, 2, batch)
        took = time.perf_counter() - start
        times.append(took)
        time.sleep(max(0.0, step_s - took))
    return times


if __name__ == "__main__":
    main()
