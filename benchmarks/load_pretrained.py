"""Loading a pretrained HF folder at 2 ranks: seconds and peak RSS per rank.

    python benchmarks/load_pretrained.py                   # small (measured vs the peer), then large
    python benchmarks/load_pretrained.py --only small      # ~1.7 GB: zdsl and the peer, like for like
    python benchmarks/load_pretrained.py --only large      # ~14 GB: zdsl; the peer by arithmetic

Writes a Llama folder of fp32 weights (safetensors shards, one per unit, and
``model.safetensors.index.json``) under ``--data`` (default /work/bench_data),
shard by shard from a seeded generator, never the whole model in memory; a
folder with the same config and every shard in place is reused. Then:

* zdsl: the load alone, at 2 ranks (``runtime/dist/spawn``: fresh processes,
  both loading at once): each rank compiles the schedule, builds the model
  lazily and constructs ``RankState``, which reads each unit's tensors from
  the files into its flat shard (host, or the NVMe tier) and drops the unit
  before the next. Reported per rank: seconds of model + RankState, peak RSS
  (``VmHWM``), against the planner's figure for the schedule (``zdsl plan``'s
  planned bytes per rank, a full step's) plus torch's floor (``zdsl run``'s
  preflight numbers). The large schedule is ZeRO-3, bf16 with the parameter
  shards and the fp32 master weights on NVMe, SGD (the schedule ``zdsl run``
  would accept on this machine); its swap files are removed afterwards.
* the peer (small size): ``AutoModelForCausalLM.from_pretrained`` on rank 0,
  the model on meta on every rank, ``fully_shard`` on each decoder layer and
  the root, ``to_empty``, then ``set_model_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)``: FSDP2's broadcast path. At the large size the
  peer is not run: its rank 0 holds the full model plus its shard, which is
  reported from arithmetic against this machine's memory.

The page cache of the weight files is dropped (``posix_fadvise DONTNEED``)
before each load, so every load reads from disk. Each rank runs with
``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go back to the OS at once).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
INDEX = "model.safetensors.index.json"
# Llama shapes: width, MLP width, layers, vocab, heads.
SIZES = {
    "small": dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=6, vocab_size=32000,
                  num_attention_heads=16),
    "large": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=16, vocab_size=32000,
                  num_attention_heads=32),
}
# The schedules: small holds its shards on the host (as FSDP2 does), large puts them on NVMe.
SCHEDULES = {
    "small": """schedule load_small "load a pretrained Llama, ZeRO-3, fp32"
model     hf("{folder}")
data      synthetic(vocab=32000, context=16)
train     steps=1, batch=1, precision=fp32
optimizer sgd(lr=1e-4)
ranks     2 on cpu
zero      3
""",
    "large": """schedule load_large "load a pretrained Llama, ZeRO-3, bf16, parameters and master weights on NVMe"
model     hf("{folder}")
data      synthetic(vocab=32000, context=16)
train     steps=1, batch=1, precision=bf16
optimizer sgd(lr=1e-4)
ranks     2 on cpu
zero      3
offload   parameters -> nvme("{swap}", block=1MiB, depth=8)
offload   optimizer  -> nvme("{swap}", block=1MiB, depth=8)
""",
}


def say(text: str) -> None:
    print(text, flush=True)


def status_kib(key: str, pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# -- the folder ----------------------------------------------------------------------------------

def config_of(size: str) -> dict:
    from transformers import LlamaConfig
    shape = SIZES[size]
    config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=2048,
                         tie_word_embeddings=False, dtype="float32")
    return config.to_dict()


def shards_of(config: dict) -> list[tuple[str, dict[str, tuple[int, ...]]]]:
    """One shard per unit: (file name, tensor name -> shape), in unit order."""
    h, f, v, L = (config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                  config["num_hidden_layers"])
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    n = L + 2
    out = [(f"model-{1:05d}-of-{n:05d}.safetensors", {"model.embed_tokens.weight": (v, h)})]
    for i in range(L):
        p = f"model.layers.{i}."
        out.append((f"model-{i + 2:05d}-of-{n:05d}.safetensors", {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}))
    out.append((f"model-{n:05d}-of-{n:05d}.safetensors", {"model.norm.weight": (h,), "lm_head.weight": (v, h)}))
    return out


def numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def write_folder(folder: Path, size: str) -> tuple[Path, int]:
    """The folder of ``size`` (written unless already complete); returns it and its parameter count."""
    import torch
    from safetensors.torch import save_file
    config = config_of(size)
    shards = shards_of(config)
    params = sum(numel(s) for _, tensors in shards for s in tensors.values())
    total = 4 * params
    index = folder / INDEX
    if index.is_file() and (folder / "config.json").is_file():
        same = json.loads((folder / "config.json").read_text()) == json.loads(json.dumps(config))
        whole = all((folder / name).is_file() for name, _ in shards)
        if same and whole:
            say(f"{folder}: already written ({params:,} parameters, {gib(total)}), reused")
            return folder, params
    folder.mkdir(parents=True, exist_ok=True)
    index.unlink(missing_ok=True)                 # written last: its presence says the folder is whole
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    say(f"{folder}: writing {params:,} parameters ({gib(total)} fp32) in {len(shards)} shards")
    g = torch.Generator().manual_seed(0)
    done, start, weight_map = 0, time.perf_counter(), {}
    for i, (name, tensors) in enumerate(shards):
        values = {}
        for tname, shape in tensors.items():
            values[tname] = (torch.ones(shape) if tname.endswith("norm.weight")
                             else torch.empty(shape).normal_(0.0, 0.02, generator=g))
            weight_map[tname] = name
        tmp = folder / (name + ".tmp")
        save_file(values, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / name)
        done += sum(v.numel() * 4 for v in values.values())
        del values
        took = time.perf_counter() - start
        say(f"  shard {i + 1}/{len(shards)}: {gib(done)} of {gib(total)}, {took:.0f} s "
            f"({done / took / GIB:.2f} GiB/s)")
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder, params


def drop_cache(folder: Path) -> None:
    """Evict the folder's files from the page cache, so the next load reads the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- zdsl ---------------------------------------------------------------------------------------

def zdsl_rank(rank: int, world: int, path: str) -> dict:
    """One rank: compile, then the load itself (model built lazily + RankState)."""
    import torch
    torch.set_num_threads(1)
    from zdsl.driver import compile_file
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    compiled = compile_file(path, None, simulate=False)
    graph, schedule = compiled.graph, compiled.schedule
    before = status_kib("VmRSS") * 1024
    start = time.perf_counter()
    model = build_model(schedule.model, seed=schedule.train.seed, lazy=True)
    if rank == 0:
        show_progress(model, start)
    state = RankState(graph, model, rank, world, device="cpu")
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") * 1024
    state.close_swap()
    return dict(seconds=seconds, peak=peak, before=before, after=status_kib("VmRSS") * 1024)


def show_progress(model, start: float) -> None:
    """Rank 0 says when each unit starts (RankState asks for them one at a time, in order, and
    shards each before the next)."""
    materialize_unit, n = model.materialize_unit, len(model.units())

    def told(u: int) -> None:
        say(f"  rank 0: unit {u + 1}/{n} from {time.perf_counter() - start:.1f} s")
        materialize_unit(u)

    model.materialize_unit = told


def planned(path: Path) -> dict:
    """The planner's figure per rank and torch's floor, as ``zdsl plan`` and ``zdsl run`` see them."""
    from zdsl.driver import compile_file
    from zdsl.planner.machine_fit import schedule_fit
    from zdsl.runtime.run.preflight import torch_floor
    compiled = compile_file(str(path), None, simulate=True)
    fit = schedule_fit(compiled, floor=torch_floor("hf"))
    return dict(planned=fit.needs.ram_per_rank, floor=fit.floor.private, shared=fit.floor.shared,
                fits=fit.fits, nvme=fit.needs.nvme_per_rank, available=fit.machine.available)


def run_zdsl(size: str, folder: Path, work: Path, swap: Path) -> dict:
    from zdsl.runtime.dist.spawn import run_ranks
    path = work / f"load_{size}.zs"
    path.write_text(SCHEDULES[size].format(folder=folder, swap=swap))
    say(f"zdsl {size}: planning {path}")
    plan = planned(path)
    say(f"  planned {gib(plan['planned'])} per rank + torch floor {gib(plan['floor'])} "
        f"(+ {gib(plan['shared'])} shared); fits this machine: {plan['fits']}")
    drop_cache(folder)
    say(f"zdsl {size}: loading at 2 ranks (page cache of the weights dropped)")
    start = time.perf_counter()
    with_env("MALLOC_MMAP_THRESHOLD_", "65536")
    try:
        ranks = run_ranks(zdsl_rank, 2, str(path))
    finally:
        with_env("MALLOC_MMAP_THRESHOLD_", None)
        if swap.exists():
            shutil.rmtree(swap, ignore_errors=True)    # the swap files (close_swap removed them already)
    wall = time.perf_counter() - start
    for r, row in enumerate(ranks):
        say(f"  rank {r}: load {row['seconds']:.1f} s, peak RSS {gib(row['peak'])} "
            f"(before the load {gib(row['before'])}); planned + floor {gib(plan['planned'] + plan['floor'])}")
    return dict(ranks=ranks, plan=plan, wall=wall)


def with_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


# -- the peer: from_pretrained on rank 0, FSDP2's broadcast ---------------------------------------

def fsdp2_rank(rank: int, world: int, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    before = status_kib("VmRSS") * 1024
    start = time.perf_counter()
    full, pretrained_s, pretrained_peak = {}, 0.0, 0
    if rank == 0:
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        pretrained_s, pretrained_peak = time.perf_counter() - start, status_kib("VmHWM") * 1024
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    # The rotary tables are not in the state dict (non-persistent): made again on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") * 1024
    check_peer_shard(model, folder, rank, world)
    dist.destroy_process_group()
    return dict(seconds=seconds, peak=peak, before=before, pretrained_s=pretrained_s,
                pretrained_peak=pretrained_peak)


def check_peer_shard(model, folder: str, rank: int, world: int) -> None:
    """The peer really loaded: this rank's rows of lm_head.weight (FSDP2 shards dim 0) are the file's."""
    import torch
    from safetensors import safe_open
    mine = model.lm_head.weight.to_local()
    rows = -(-model.lm_head.weight.shape[0] // world)
    index = json.loads((Path(folder) / INDEX).read_text())["weight_map"]
    with safe_open(str(Path(folder) / index["lm_head.weight"]), framework="pt") as f:
        expected = f.get_slice("lm_head.weight")[rank * rows:(rank + 1) * rows]
    if not torch.equal(mine[:expected.shape[0]], expected):
        raise RuntimeError(f"peer rank {rank}: lm_head.weight's shard differs from the file")


def run_peer(folder: Path) -> dict:
    from zdsl.runtime.dist.spawn import run_ranks
    drop_cache(folder)
    say("peer: from_pretrained on rank 0 + FSDP2 broadcast at 2 ranks (page cache dropped)")
    with_env("MALLOC_MMAP_THRESHOLD_", "65536")
    try:
        ranks = run_ranks(fsdp2_rank, 2, str(folder))
    finally:
        with_env("MALLOC_MMAP_THRESHOLD_", None)
    say(f"  rank 0: from_pretrained {ranks[0]['pretrained_s']:.1f} s, peak RSS then "
        f"{gib(ranks[0]['pretrained_peak'])}")
    for r, row in enumerate(ranks):
        say(f"  rank {r}: load {row['seconds']:.1f} s, peak RSS {gib(row['peak'])} (before {gib(row['before'])})")
    return dict(ranks=ranks)


def peer_arithmetic(params: int, floor: int, available: int) -> str:
    """What the peer needs at this size: rank 0 holds the full fp32 model from from_pretrained and
    its FSDP2 shard, rank 1 its shard; plus each process's torch floor."""
    full, shard = 4 * params, 4 * params // 2
    need = full + 2 * shard + 2 * floor
    return (f"cannot fit: needs {gib(need)} (rank 0: the full model {gib(full)} + its shard {gib(shard)}; "
            f"rank 1: its shard {gib(shard)}; + 2 x torch floor {gib(floor)}), {gib(available)} available")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/work/bench_data", help="where the model folders are written")
    parser.add_argument("--only", choices=sorted(SIZES), help="one size only")
    args = parser.parse_args()
    data = Path(args.data)
    rows = {}
    for size in ([args.only] if args.only else ["small", "large"]):
        folder, params = write_folder(data / f"llama-{size}", size)
        need_disk = (4 * params) if size == "large" else 0
        free = shutil.disk_usage(data).free
        if need_disk and free < need_disk + 10 * GIB:
            say(f"zdsl {size}: {gib(free)} free in {data}, the swap files need {gib(need_disk)} + 10 GiB spare")
            return 1
        swap = data / f"swap-{size}"
        z = run_zdsl(size, folder, data, swap)
        peer = run_peer(folder) if size == "small" else None
        rows[size] = (params, z, peer)
    say("\n| size | who | seconds (rank 0 / 1) | peak RSS per rank (rank 0 / 1) | planned + torch floor |")
    say("|---|---|---|---|---|")
    for size, (params, z, peer) in rows.items():
        label = f"{size}: {params / 1e9:.2f}e9 params, {gib(4 * params)} fp32"
        r = z["ranks"]
        say(f"| {label} | zdsl | {r[0]['seconds']:.1f} / {r[1]['seconds']:.1f} | {gib(r[0]['peak'])} / "
            f"{gib(r[1]['peak'])} | {gib(z['plan']['planned'] + z['plan']['floor'])} |")
        if peer is not None:
            p = peer["ranks"]
            say(f"| {label} | from_pretrained alone (its rank 0) | {p[0]['pretrained_s']:.1f} | "
                f"{gib(p[0]['pretrained_peak'])} | - |")
            say(f"| {label} | from_pretrained + FSDP2 broadcast | {p[0]['seconds']:.1f} / {p[1]['seconds']:.1f} "
                f"| {gib(p[0]['peak'])} / {gib(p[1]['peak'])} | - |")
            say(f"| {label} | ratio zdsl / peer | {r[0]['seconds'] / p[0]['seconds']:.2f}x | "
                f"{r[0]['peak'] / p[0]['peak']:.2f}x / {r[1]['peak'] / p[1]['peak']:.2f}x | |")
        else:
            say(f"| {label} | from_pretrained + FSDP2 broadcast | not run | "
                f"{peer_arithmetic(params, z['plan']['floor'], z['plan']['available'])} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
