"""NVMe tier throughput: zdsl's Swapper against fio on the same folder.

Both sides use direct I/O with the same block size and queue depth: fio
with ``libaio`` and ``iodepth=qd`` (or ``psync`` with ``numjobs=qd`` where
libaio is missing), the swapper with ``qd`` worker threads issuing
``pwritev``/``preadv`` of one block each. Where fio cannot be had, ``dd``
with ``oflag=direct``/``iflag=direct`` is the baseline (queue depth 1, so the
ratio then flatters us; the table says which baseline ran).

Each repeat writes a fresh file (fio and the swapper both preallocate it)
and reads it back after dropping the page cache where permitted; repeats
alternate between the two tools so that load from other processes hits
both alike. The figure reported is the median over repeats.

``--folders A,B,...`` adds the swapper striped over those folders (one file per
folder, block i in folder i mod n, as ``nvme("A", "B")`` does), run in the same
rounds as the swapper on A alone, the order turned each round; the ratio
striped / one folder is the figure (on folders of one disk it should be about
1, on distinct drives up to their number).

    python benchmarks/nvme_io.py [--folder /tmp/zdsl-bench | --folders A,B] [--size 1GiB]
                                 [--block 1MiB] [--qd 8] [--repeat 3] [--no-verify]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import trio

from zdsl.runtime.io.aligned import aligned_empty
from zdsl.runtime.offload.swap import Swapper
from zdsl.runtime.io import checksum

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1GiB, 512MiB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def setup() -> str | None:
    """Make fio available (apt-get, as root, where missing); return its path or None."""
    fio = shutil.which("fio")
    if fio:
        return fio
    if shutil.which("apt-get") and os.geteuid() == 0:
        print("fio not found: installing it with apt-get ...", flush=True)
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "fio"]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
                break
    return shutil.which("fio")


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fio_engine(fio: str) -> str:
    engines = subprocess.run([fio, "--enghelp"], capture_output=True, text=True).stdout
    return "libaio" if "libaio" in engines else "psync"


def run_fio(fio: str, engine: str, path: Path, rw: str, size: int, block: int, qd: int) -> float:
    """Bytes per second of one fio job (write or read) over `size` bytes of `path`."""
    args = [fio, "--name=zdsl", f"--filename={path}", f"--rw={rw}", f"--bs={block}", "--direct=1",
            f"--ioengine={engine}", "--output-format=json", "--group_reporting", "--fallocate=native"]
    if engine == "libaio":
        args += [f"--iodepth={qd}", f"--size={size}"]
    else:  # qd synchronous jobs, each on its own slice of the one file
        share = size // qd // block * block
        args += [f"--numjobs={qd}", f"--size={share}", f"--offset_increment={share}"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {done.stderr.strip()[-500:]}")
    job = json.loads(done.stdout)["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def run_dd(path: Path, rw: str, size: int, block: int) -> float:
    count = size // block
    if rw == "write":
        args = ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=fsync"]
    else:
        args = ["dd", f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"]
    start = time.perf_counter()
    subprocess.run(args, capture_output=True, check=True)
    return count * block / (time.perf_counter() - start)


def ours(folders: list[Path], data: torch.Tensor, out: torch.Tensor, block: int, qd: int, verify: bool,
         mode: str) -> tuple[float, float]:
    """(write, read) bytes per second of the swapper over ``folders``, async (trio) or sync API."""
    with Swapper(folders, block_bytes=block, queue_depth=qd, verify=verify) as swapper:
        if mode == "async":
            start = time.perf_counter()
            trio.run(swapper.write, "bench", data)
            write_s = time.perf_counter() - start
            drop_caches()
            start = time.perf_counter()
            trio.run(swapper.read, "bench", out)
            read_s = time.perf_counter() - start
        else:
            start = time.perf_counter()
            swapper.write_sync("bench", data)
            write_s = time.perf_counter() - start
            drop_caches()
            start = time.perf_counter()
            swapper.read_sync("bench", out)
            read_s = time.perf_counter() - start
    if not torch.equal(data, out):
        raise RuntimeError("swapper read back different bytes")
    out.zero_()
    return data.numel() / write_s, data.numel() / read_s


def measure_rounds(args, striped: list[Path] | None, fio: str | None, engine: str | None, size: int,
                   data: torch.Tensor, out: torch.Tensor) -> dict[str, list[float]]:
    """Bytes per second of each way, one figure per round; the ways' order turned each round, so the
    host's slow spells hit them alike."""
    verify = not args.no_verify
    base_file = args.folder / "baseline.dat"

    def baseline() -> tuple[float, float]:
        base_file.unlink(missing_ok=True)
        drop_caches()
        if fio:
            w = run_fio(fio, engine, base_file, "write", size, args.block, args.qd)
            drop_caches()
            r = run_fio(fio, engine, base_file, "read", size, args.block, args.qd)
        else:
            w = run_dd(base_file, "write", size, args.block)
            drop_caches()
            r = run_dd(base_file, "read", size, args.block)
        base_file.unlink(missing_ok=True)
        return w, r

    ways = {"ours": lambda: ours([args.folder], data, out, args.block, args.qd, verify, "async"),
            "base": baseline,
            "sync": lambda: ours([args.folder], data, out, args.block, args.qd, verify, "sync")}
    if striped:
        ways["stripe"] = lambda: ours(striped, data, out, args.block, args.qd, verify, "async")
        ways["stripesync"] = lambda: ours(striped, data, out, args.block, args.qd, verify, "sync")
    results: dict[str, list[float]] = {f"{k}_{d}": [] for k in ways for d in "wr"}
    names = list(ways)
    for round_ in range(args.repeat):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            w, r = ways[name]()
            results[f"{name}_w"].append(w)
            results[f"{name}_r"].append(r)
    return results


def report(results: dict[str, list[float]], striped: list[Path] | None) -> None:
    med = {k: statistics.median(v) / GiB for k, v in results.items()}
    print(f"\n{'':6s} {'ours async':>12s} {'ours sync':>12s} {'baseline':>12s} {'async/base':>11s} {'sync/base':>10s}")
    for op, key in (("write", "w"), ("read", "r")):
        o, s, b = med[f"ours_{key}"], med[f"sync_{key}"], med[f"base_{key}"]
        print(f"{op:6s} {o:9.2f} GiB/s {s:6.2f} GiB/s {b:6.2f} GiB/s {o / b:11.2f} {s / b:10.2f}")
    if striped:
        print(f"\nstriped over {len(striped)} folders ({', '.join(map(str, striped))}) against the first alone:")
        print(f"{'':6s} {'striped async':>14s} {'striped sync':>13s} {'async/one':>10s} {'sync/one':>9s}")
        for op, key in (("write", "w"), ("read", "r")):
            a, s = med[f"stripe_{key}"], med[f"stripesync_{key}"]
            print(f"{op:6s} {a:9.2f} GiB/s {s:6.2f} GiB/s {a / med[f'ours_{key}']:10.2f} "
                  f"{s / med[f'sync_{key}']:9.2f}")
    spread = {k: (min(v) / GiB, max(v) / GiB) for k, v in results.items()}
    print("\nrange over repeats (GiB/s): " + ", ".join(f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in spread.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", default="/tmp/zdsl-bench", type=Path)
    ap.add_argument("--folders", type=lambda text: [Path(f) for f in text.split(",") if f],
                    help="comma-separated: the swapper striped over them beside it on the first alone")
    ap.add_argument("--size", default="1GiB", type=parse_bytes)
    ap.add_argument("--block", default="1MiB", type=parse_bytes)
    ap.add_argument("--qd", default=8, type=int)
    ap.add_argument("--repeat", default=3, type=int)
    ap.add_argument("--no-verify", action="store_true", help="swapper without per-block CRC32")
    ap.add_argument("--no-fio", action="store_true", help="use dd as the baseline")
    ap.add_argument("--engine", choices=["libaio", "psync"], help="fio engine (default: libaio where fio has it)")
    args = ap.parse_args(argv)
    folders = args.folders or [args.folder]
    args.folder = folders[0]
    size = args.size // args.block * args.block
    if size <= 0 or args.block % 4096:
        print("size must hold at least one block, and the block must be a multiple of 4 KiB")
        return 2

    fio = None if args.no_fio else setup()
    engine = (args.engine or fio_engine(fio)) if fio else None
    baseline = f"fio ({engine}, {'iodepth' if engine == 'libaio' else 'numjobs'}={args.qd})" if fio else "dd (qd 1)"
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    dropped = drop_caches()
    print(f"folder {', '.join(map(str, folders))}, {size / GiB:.2f} GiB, block {args.block >> 10} KiB, "
          f"queue depth {args.qd}, "
          f"verify={'off' if args.no_verify else checksum.DEFAULT.algo}, "
          f"page cache drop {'yes' if dropped else 'not permitted'}, "
          f"baseline {baseline}, {args.repeat} repeats (median)")

    data = aligned_empty(size)
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 256, (min(size, 1 << 22),), dtype=torch.uint8, generator=gen)
    for a in range(0, size, pattern.numel()):
        data[a : a + pattern.numel()] = pattern[: size - a]
    out = aligned_empty(size)
    out.zero_()  # fault the pages in before timing

    striped = folders if len(folders) > 1 else None
    results = measure_rounds(args, striped, fio, engine, size, data, out)
    report(results, striped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
