"""Checkpoint save and load throughput against the disk's direct-I/O bandwidth.

    python benchmarks/checkpoint_io.py --gb 2 --ranks 2 --dir /tmp/zdsl-ckpt-bench

Measures, in one run and on one folder: the disk's direct-I/O write and
read bandwidth (fio if installed, else dd with oflag/iflag=direct, the
same byte count as the checkpoint), then a checkpoint save of that many
bytes of fp32 shards (``ranks`` writers at once, as the ranks of a run
would, then the index) and its load (every rank's shards, same layout,
page cache dropped for the files first) both into new tensors and into
buffers the rank already holds, and a load re-cut to twice the rank count. Prints each throughput and its ratio to the disk's (target
>= 0.7), the CPU seconds per GB (checksums and copies: what a save takes
from training), and one JSON line for scripts. Also times the checksum
candidates (CRC-32C/CRC-32 per 16 MiB block was chosen over SHA-256 per
file). On a host shared with other jobs run it twice: CPU contention
shows as a low crc32 figure on the last line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

from zdsl.model.layout import flat_layout
from zdsl.runtime.checkpoint.stformat import CHECKSUM
from zdsl.runtime.checkpoint import (checkpoint_path, load_for_rank, owned_shard, unit_metas, write_index,
                                     write_rank_shards)
from zdsl.model.units import UnitSpec

GB = 1e9


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(folder: Path, nbytes: int, jobs: int) -> tuple[float, float, str]:
    """(write GB/s, read GB/s, tool): ``jobs`` parallel streams of direct I/O, ``nbytes`` in all.

    Parallel streams because the checkpoint is written by ``jobs`` ranks at
    once; fio if installed, else dd (oflag/iflag=direct).
    """
    block = 64 << 20
    count = max(1, nbytes // jobs // block)
    paths = [folder / f"direct-io-{j}.bench" for j in range(jobs)]
    total = count * block * jobs
    try:
        if shutil.which("fio"):
            def fio(rw):
                out = subprocess.run(["fio", "--name=bw", f"--directory={folder}", f"--rw={rw}", "--bs=64M",
                                      f"--size={count * block}", f"--numjobs={jobs}", "--group_reporting",
                                      "--direct=1", "--ioengine=psync", "--end_fsync=1", "--output-format=json"],
                                     capture_output=True, text=True, check=True)
                job = json.loads(out.stdout)["jobs"][0]["write" if rw == "write" else "read"]
                return job["bw_bytes"] / GB
            return fio("write"), fio("read"), "fio"

        def dd(make_args):
            t = time.perf_counter()
            procs = [subprocess.Popen(["dd", *make_args(p), "bs=64M", f"count={count}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in paths]
            if any(p.wait() for p in procs):
                raise RuntimeError("dd failed")
            return total / (time.perf_counter() - t) / GB
        w = dd(lambda p: ["if=/dev/zero", f"of={p}", "oflag=direct", "conv=fsync"])
        r = dd(lambda p: [f"if={p}", "of=/dev/null", "iflag=direct"])
        return w, r, "dd"
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        for p in folder.glob("bw.*"):
            p.unlink()


def checksum_speed(nbytes: int = 256 << 20) -> dict[str, float]:
    data = torch.empty(nbytes // 4).uniform_().view(torch.uint8).numpy()
    out = {}
    fns = [("crc32", zlib.crc32), ("sha256", lambda b: hashlib.sha256(b).digest())]
    try:
        from crc32c import crc32c
        fns.insert(0, ("crc32c", crc32c))
    except ImportError:
        pass
    for name, fn in fns:
        t = time.perf_counter()
        fn(memoryview(data))
        out[name] = nbytes / (time.perf_counter() - t) / GB
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_parallel(fn, ranks: int) -> float:
    """Wall seconds of ``fn(rank)`` run for every rank at once (threads stand in for rank processes)."""
    errors = []

    def work(r):
        try:
            fn(r)
        except BaseException as e:      # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r,)) for r in range(ranks)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/zdsl-ckpt-bench")
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (all ranks together)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="best of N for each measurement")
    args = ap.parse_args(argv)

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    total = int(args.gb * GB)
    kinds = ("param", "exp_avg", "exp_avg_sq")
    numel = total // 4 // len(kinds) // args.units
    units = [UnitSpec(f"u{i}", [("w", (numel,))]) for i in range(args.units)]
    layouts = [flat_layout(numel, args.ranks, 256 << 20) for _ in units]
    print(f"checkpoint: {args.units} units x {len(kinds)} kinds x {numel * 4 / 1e6:.0f} MB, {args.ranks} ranks, "
          f"{total / GB:.2f} GB, in {root}", flush=True)
    shards = [{f"u{i}.{k}": owned_shard(torch.empty(numel).uniform_(), layouts[i], r)
               for i in range(args.units) for k in kinds} for r in range(args.ranks)]
    nbytes = sum(t.numel() * 4 for s in shards for t in s.values())


    dest = [{k: torch.zeros_like(v) for k, v in s.items()} for s in shards]
    save_s, load_s, into_s, raw_s, recut_s, save_cpu, load_cpu = [], [], [], [], [], [], []
    disk_w, disk_r = [], []
    for rep in range(args.repeat):
        # The disk measured in each round, beside the checkpoint's own I/O: both see the same neighbours.
        w, r, tool = disk_bandwidth(root, nbytes, args.ranks)
        disk_w.append(w)
        disk_r.append(r)
        print(f"round {rep + 1}: disk direct I/O ({tool}, {args.ranks} streams): write {w:.2f} GB/s, "
              f"read {r:.2f} GB/s", flush=True)
        step = rep + 1
        records = [None] * args.ranks

        def save(r):
            records[r] = write_rank_shards(root, step, r, args.ranks, shards[r], tag=str(step))
        t, c = time.perf_counter(), cpu_seconds()
        run_parallel(save, args.ranks)
        write_index(root, step, {"units": unit_metas(units, layouts)}, records, tag=str(step))
        save_s.append(time.perf_counter() - t)
        save_cpu.append(cpu_seconds() - c)

        path = checkpoint_path(root, step)
        drop_cache(path.glob("rank-*.safetensors"))
        load_s.append(run_parallel(lambda r: load_for_rank(path, r, args.ranks, layouts), args.ranks))

        # Into the buffers a running rank already holds (touched memory, as RankState's shards).
        drop_cache(path.glob("rank-*.safetensors"))
        c = cpu_seconds()
        into_s.append(run_parallel(lambda r: load_for_rank(path, r, args.ranks, layouts, into=dest[r]), args.ranks))
        load_cpu.append(cpu_seconds() - c)

        # The same without checksums: the I/O path alone (what the checks cost is the difference).
        drop_cache(path.glob("rank-*.safetensors"))
        raw_s.append(run_parallel(lambda r: load_for_rank(path, r, args.ranks, layouts, into=dest[r], verify=False),
                                  args.ranks))

        drop_cache(path.glob("rank-*.safetensors"))
        new = [flat_layout(numel, 2 * args.ranks, 200 << 20) for _ in units]
        recut_s.append(run_parallel(lambda r: load_for_rank(path, r, 2 * args.ranks, new), 2 * args.ranks))
        if rep + 1 < args.repeat:
            shutil.rmtree(path)

    save_bw, load_bw, into_bw, raw_bw, recut_bw = (nbytes / min(s) / GB
                                                   for s in (save_s, load_s, into_s, raw_s, recut_s))
    save_cpu_gb, load_cpu_gb = min(save_cpu) / (nbytes / GB), min(load_cpu) / (nbytes / GB)
    dw, dr = max(disk_w), max(disk_r)                 # best of N on both sides
    mw, mr = sorted(disk_w)[len(disk_w) // 2], sorted(disk_r)[len(disk_r) // 2]
    sums = checksum_speed()
    result = {"bytes": nbytes, "ranks": args.ranks, "disk_tool": tool,
              "disk_write_gbs": round(dw, 3), "disk_read_gbs": round(dr, 3),
              "disk_write_median_gbs": round(mw, 3), "disk_read_median_gbs": round(mr, 3),
              "save_gbs": round(save_bw, 3), "load_gbs": round(load_bw, 3), "load_into_gbs": round(into_bw, 3),
              "recut_load_gbs": round(recut_bw, 3),
              "save_ratio": round(save_bw / dw, 3), "load_ratio": round(load_bw / dr, 3),
              "load_into_ratio": round(into_bw / dr, 3), "load_unverified_gbs": round(raw_bw, 3),
              "save_cpu_s_per_gb": round(save_cpu_gb, 3), "load_cpu_s_per_gb": round(load_cpu_gb, 3),
              "recut_ratio": round(recut_bw / dr, 3),
              "checksum": CHECKSUM, **{f"{k}_gbs": round(v, 2) for k, v in sums.items()}}
    print(f"disk   best write {dw:.2f} GB/s, read {dr:.2f} GB/s; median write {mw:.2f}, read {mr:.2f} "
          f"(ratios below are against the best)")
    print(f"save   {save_bw:.2f} GB/s = {save_bw / dw:.2f} x direct write  (target >= 0.7; "
          f"{save_bw / mw:.2f} x the median)")
    print(f"load   {load_bw:.2f} GB/s = {load_bw / dr:.2f} x direct read   (target >= 0.7; into new tensors; "
          f"{load_bw / mr:.2f} x the median)")
    print(f"load   {into_bw:.2f} GB/s = {into_bw / dr:.2f} x direct read   (into the rank's existing buffers)")
    print(f"load   {raw_bw:.2f} GB/s = {raw_bw / dr:.2f} x direct read   (into existing buffers, checksums off)")
    print(f"cpu    save {save_cpu_gb:.2f} s/GB, load {load_cpu_gb:.2f} s/GB (checksum + copy; the disk's DMA needs none)")
    print(f"re-cut {recut_bw:.2f} GB/s = {recut_bw / dr:.2f} x direct read   ({args.ranks} -> {2 * args.ranks} ranks)")
    print("checksums (one core): " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in sums.items())
          + f"; files use {CHECKSUM}")
    print(json.dumps(result))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
