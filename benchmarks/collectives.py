"""zdsl's gloo collectives against torch's flat ones, the same bytes, the same ranks.

    python benchmarks/collectives.py                    # 2 ranks, 1 MiB .. 73 MiB
    python benchmarks/collectives.py --ranks 4 --sizes 12MiB,73MiB --repeat 9

``runtime/dist/collectives.py`` runs an all-gather on gloo as one broadcast per
owner, and a reduce-scatter at 2 ranks as an exchange of halves (at more, an
in-place all-reduce, or one reduce per owner, keeping this rank's slice),
because gloo's own flat ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
are slower for the same bytes. This measures every algorithm through the runtime's own functions
(selected by setting its ``GLOO_ALL_GATHER`` / ``GLOO_REDUCE_SCATTER``),
interleaved, median of ``--repeat`` per size, and prints ours / torch's.
Sizes are of the full (gathered) tensor; 73 MiB is the 19M-parameter GPT of
``vs_peers.py`` in fp32, 12 MiB one of its blocks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.runtime.dist.spawn import run_ranks          # noqa: E402
from zdsl.lang.sizes import format_size, parse_size     # noqa: E402

GATHER = ("native", "broadcast", "shm")
SCATTER = ("native", "exchange", "all_reduce", "reduce", "shm")   # exchange, shm: 2 ranks (else all_reduce)
REDUCE = ("native", "shm")                                         # all-reduce; shm: 2 ranks of one host


def _rank(rank: int, world: int, sizes: list[int], repeat: int) -> list | None:
    import torch
    import torch.distributed as dist

    from zdsl.runtime.dist import collectives
    torch.set_num_threads(1)
    # every algorithm at every size (where shm cannot serve, the runtime uses gloo's own below 1 MiB)
    collectives.GLOO_NATIVE_BELOW = 0
    dist.init_process_group("gloo", rank=rank, world_size=world)      # rendezvous: the spawner's MASTER_*
    try:
        rows = []
        for size in sizes:
            n = size // 4 // world * world
            full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
            shard = torch.empty(n // world)
            out = torch.empty(n)
            times: dict[str, list[float]] = {}

            def timed(key: str, fn) -> None:
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.setdefault(key, []).append(time.perf_counter() - t)

            for r in range(repeat + 1):          # the first round warms up and is dropped
                for algorithm in GATHER:
                    collectives.GLOO_ALL_GATHER = algorithm
                    timed(f"all_gather {algorithm}", lambda: collectives.all_gather(out, shard))
                for algorithm in SCATTER:
                    collectives.GLOO_REDUCE_SCATTER = algorithm
                    inp = full.clone()           # consumed by the non-native algorithms
                    timed(f"reduce_scatter {algorithm}", lambda: collectives.reduce_scatter(shard, inp))
                for algorithm in REDUCE:
                    collectives.GLOO_ALL_REDUCE = algorithm
                    inp = full.clone()
                    timed(f"all_reduce {algorithm}", lambda: collectives.all_reduce(inp))
                if r == 0:
                    times.clear()
            # the slowest rank's time is the collective's
            every = [None] * world
            dist.all_gather_object(every, times)
            worst = {k: [max(ts[k][i] for ts in every) for i in range(repeat)] for k in times}
            rows.append((size, {k: statistics.median(v) for k, v in worst.items()}))
        return rows if rank == 0 else None
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="1MiB,12MiB,73MiB", help="comma list of full-tensor sizes")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    from zdsl.runtime.dist import collectives
    ours = dict(AG=collectives.GLOO_ALL_GATHER, RS=collectives.GLOO_REDUCE_SCATTER,   # the runtime's defaults,
                AR=collectives.GLOO_ALL_REDUCE)                                       # before a rank changes them
    rows = run_ranks(_rank, args.ranks, sizes, args.repeat)[0]
    print(f"gloo, {args.ranks} ranks on {os.cpu_count()} cores, median of {args.repeat} "
          f"(slowest rank per call), ms")
    head = f"{'size':>8}  " + "".join(f"{'AG ' + a:>14}" for a in GATHER) + \
        "".join(f"{'RS ' + a:>16}" for a in SCATTER) + "".join(f"{'AR ' + a:>12}" for a in REDUCE) + \
        f"{'AG ours/torch':>15}{'RS ours/torch':>15}{'AR ours/torch':>15}"
    print(head)
    for size, med in rows:
        line = f"{format_size(size):>8}  "
        line += "".join(f"{med[f'all_gather {a}'] * 1e3:14.1f}" for a in GATHER)
        line += "".join(f"{med[f'reduce_scatter {a}'] * 1e3:16.1f}" for a in SCATTER)
        line += "".join(f"{med[f'all_reduce {a}'] * 1e3:12.1f}" for a in REDUCE)
        ag = med[f"all_gather {ours['AG']}"] / med["all_gather native"]
        rs = med[f"reduce_scatter {ours['RS']}"] / med["reduce_scatter native"]
        ar = med[f"all_reduce {ours['AR']}"] / med["all_reduce native"]
        print(line + f"{ag:15.2f}{rs:15.2f}{ar:15.2f}")
    print(f"ours = the defaults (all-gather: {ours['AG']}, reduce-scatter: {ours['RS']}, all-reduce: {ours['AR']}; "
          f"shm serves 2 ranks of one host at any size; elsewhere, below 1 MiB, gloo's own); < 1 means faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
