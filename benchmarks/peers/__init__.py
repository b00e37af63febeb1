"""The harness every peer job of ``benchmarks/vs_peers.py`` shares.

Why one harness: the comparison is only fair when every system trains the
same model from the same init on the same batches with the same optimizer,
and is timed and measured the same way. The peers (``ddp_peer``,
``fsdp2_peer``, ``deepspeed_peer``) differ only in how they wrap the model
and take a step; everything else lives here.

A peer job is one process per rank, started by ``torchrun`` with
``--config CONFIG.json --out DIR``. Each rank writes ``DIR/rank{r}.json``:
its step times and CPU seconds (user + system, every thread), its losses, its
peak RSS (``VmHWM``), the RSS it had before building the model, the cores it
ran on and the scheduling policy its gloo event-loop threads had, and (on CUDA)
torch's peak allocated bytes.

This module imports torch only inside the functions that run in a rank, so
the orchestrator can import :class:`BenchConfig` without paying for torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# "gpt": zdsl's built-in GPT; "hf:llama": a transformers LlamaForCausalLM saved once (hf_llama.py)
MODELS = ("gpt", "hf:llama")
# "cores": each rank of every peer on its own share of the cores (zdsl's default; DeepSpeed's
# --bind_cores_to_rank; taskset for torch's ranks); "none": every peer's ranks unbound
BINDINGS = ("cores", "none")
# "equal": every peer with the same binding and zdsl's gloo loop policy; "as-they-come": zdsl with
# its defaults (bound, its policy), DDP, FSDP2 and DeepSpeed with theirs (unbound, the OS's policy)
TERMS = ("equal", "as-they-come")


@dataclass
class BenchConfig:
    """What every peer trains: model, data, optimizer, and how many steps."""
    layers: int = 6
    width: int = 512
    heads: int = 8
    vocab: int = 256
    context: int = 256
    batch: int = 1                      # sequences per rank per step
    steps: int = 8                      # measured steps
    warmup: int = 2                     # steps run first and left out of the timing
    seed: int = 0                       # model init and data
    data: str = "synthetic"             # "synthetic" or "stdlib" (zdsl's built-in corpus)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    model: str = "gpt"                  # one of MODELS
    hf_dir: str = ""                    # model "hf:llama": the saved folder every peer loads
    bind: str = "cores"                 # one of BINDINGS
    loop_policy: str = ""               # gloo loop threads' policy (affinity.LOOP_POLICIES); "": left as is
    extra: dict = field(default_factory=dict)   # per-peer knobs (e.g. the DeepSpeed stage)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def model_kwargs(self) -> dict:
        return dict(layers=self.layers, width=self.width, heads=self.heads,
                    vocab=self.vocab, context=self.context)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        raw = json.loads(text)
        raw["betas"] = tuple(raw["betas"])
        return cls(**raw)


# -- what a rank measures -------------------------------------------------------

def _proc_status_bytes(key: str) -> int | None:
    """A ``kB`` line of /proc/self/status in bytes (VmHWM = peak RSS, VmRSS = now)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark; getrusage where /proc is missing."""
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    scale = 1 if sys.platform == "darwin" else 1024    # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def rss_bytes() -> int:
    return _proc_status_bytes("VmRSS") or 0


# -- model and data: the same for every peer --------------------------------------

def build_model(cfg: BenchConfig):
    """The model with the init every peer shares (seeded, on CPU, fp32).

    The GPT seeds its own private generator, exactly as ``zdsl run`` builds it
    from the schedule's ``seed``, so zdsl starts from the same numbers too. The
    HF Llama is ``from_pretrained`` of the one folder zdsl also reads.
    """
    if cfg.model == "hf:llama":
        from benchmarks.peers import hf_llama
        return hf_llama.load(cfg)
    from zdsl.runtime.models.gpt import GPT
    return GPT(**cfg.model_kwargs(), seed=cfg.seed)


def blocks(cfg: BenchConfig, model) -> list:
    """The repeated blocks (FSDP2's per-block shard groups): GPT's middle units, Llama's decoder layers."""
    if cfg.model == "hf:llama":
        from benchmarks.peers import hf_llama
        return hf_llama.blocks(model)
    return model.units()[1:-1]


def forward_loss(cfg: BenchConfig):
    """``loss(model, tokens, targets)`` for this model: the GPT's own forward, or HF logits' cross entropy."""
    if cfg.model == "hf:llama":
        from benchmarks.peers import hf_llama
        return hf_llama.loss
    return lambda model, tokens, targets: model(tokens, targets)


def data_spec(cfg: BenchConfig):
    """The ``data`` statement zdsl sees for this config (also written into the .zs)."""
    from zdsl.schedule import DataSpec
    if cfg.data == "stdlib":
        return DataSpec("corpus", source="stdlib", args=dict(context=cfg.context))
    return DataSpec("synthetic", args=dict(vocab=cfg.vocab, context=cfg.context))


def data_statement(cfg: BenchConfig) -> str:
    """The same data as .zs source text."""
    if cfg.data == "stdlib":
        return f'corpus("stdlib", context={cfg.context})'
    return f"synthetic(vocab={cfg.vocab}, context={cfg.context})"


def batch_for(cfg: BenchConfig, spec, step: int, rank: int, world: int):
    """(tokens, targets) that ``rank`` trains on at ``step``: zdsl's own data source."""
    from zdsl.runtime.data import make_batch
    return make_batch(spec, cfg.seed, step, 0, rank, world, cfg.batch)


def plain_step(cfg: BenchConfig, model, optimizer):
    """One training step as a user of a wrapper writes it: forward, backward, step, zero."""
    loss_of = forward_loss(cfg)

    def step(tokens, targets):
        loss = loss_of(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def adamw(cfg: BenchConfig, params):
    import torch
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


# -- the job a peer runs ----------------------------------------------------------

def _parse_job_args(argv=None) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(description="one peer job of benchmarks/vs_peers.py")
    parser.add_argument("--config", required=True, help="BenchConfig as JSON file")
    parser.add_argument("--out", required=True, help="folder for rank{r}.json")
    args = parser.parse_args(argv)
    return BenchConfig.from_json(Path(args.config).read_text()), Path(args.out)


def run_peer(name: str, setup, backend: str = "gloo", argv=None) -> None:
    """Run one peer on this rank: build, train, time, measure, write the result.

    ``setup(cfg, rank, world)`` returns ``(step, info)``: ``step(tokens,
    targets)`` does forward, backward and the optimizer step and returns
    the (detached) loss; ``info`` is a dict reported beside the numbers.
    Ranks meet at a barrier before every step so a step's time is the
    system's, not the wait for a slower rank's previous step. With
    ``cfg.extra["timing"] == "loop"`` they meet once, before the first step, and a step's time
    is the wall time of the whole loop from the previous step's end (its batch made, its loss
    read), as ``zdsl run``'s loop is timed between its metrics lines (``zdsl_peer.py``).
    Under ``cfg.loop_policy`` gloo's event-loop threads get zdsl's policy as soon as the group
    exists, and again after ``setup`` (which may make groups of its own, each with its loops).
    """
    cfg, out = _parse_job_args(argv)
    given = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    bind_rank(cfg)                  # before torch starts a thread: each inherits the mask, as under taskset
    import torch
    import torch.distributed as dist

    from zdsl.runtime.dist.affinity import calm_gloo_loops, loop_policies

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if cfg.loop_policy:
        calm_gloo_loops(policy=cfg.loop_policy)
    rank, world = dist.get_rank(), dist.get_world_size()
    base_rss = rss_bytes()

    spec = data_spec(cfg)
    step, info = setup(cfg, rank, world)
    if cfg.loop_policy:
        calm_gloo_loops(policy=cfg.loop_policy)
    times, cpu, losses = [], [], []
    whole_loop = cfg.extra.get("timing") == "loop"
    if whole_loop:
        dist.barrier()
        end, end_cpu = time.perf_counter(), time.process_time()
    for i in range(cfg.total_steps):
        if whole_loop:      # from the previous step's end: the batch made, the loss read, no barrier
            start, start_cpu = end, end_cpu
        tokens, targets = batch_for(cfg, spec, i, rank, world)
        if not whole_loop:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
        loss = step(tokens, targets)
        end, end_cpu = time.perf_counter(), time.process_time()
        times.append(end - start)
        cpu.append(end_cpu - start_cpu)
        losses.append(float(loss))
    dist.barrier()

    result = dict(peer=name, rank=rank, world=world, step_s=times, cpu_s=cpu, loss=losses,
                  warmup=cfg.warmup, peak_rss=peak_rss_bytes(), base_rss=base_rss,
                  cuda_peak=(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None),
                  torch=torch.__version__, ran_with=ran_with(given, loop_policies()), info=info)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def ran_with(given: list[int] | None, loop_policy: dict[str, int]) -> dict:
    """What this rank ran with, as measured at its end: its cores, whether they are a binding
    (fewer than the ``given`` cores the job started with), and how many gloo loop threads had
    which policy."""
    if given is None:
        return dict(cores=None, bound=False, loop_policy=loop_policy)
    cores = sorted(os.sched_getaffinity(0))
    return dict(cores=cores, bound=cores != given, loop_policy=loop_policy)


def bind_rank(cfg: BenchConfig) -> list[int] | None:
    """With ``cfg.bind == "cores"``, restrict this process to its rank's share of the cores.

    The share is zdsl's (``zdsl.runtime.dist.affinity.rank_cores``: an even,
    contiguous slice; no binding with fewer cores than ranks), which is also
    the cores DeepSpeed's ``--bind_cores_to_rank`` gives a rank. Called first
    thing in a rank, it is ``taskset -c CORES`` on the rank's command line.
    """
    if cfg.bind != "cores" or not hasattr(os, "sched_setaffinity"):
        return None
    from zdsl.runtime.dist.affinity import rank_cores
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    available = sorted(os.sched_getaffinity(0))
    mine = rank_cores(local_rank, local_world, available)
    if mine == available:
        return None
    os.sched_setaffinity(0, mine)
    return mine


def job_env(cfg: BenchConfig | None = None) -> dict:
    """Environment for a peer job: one intra-op thread, CPU DeepSpeed, repo importable, and
    zdsl's ranks bound or not and their loop policy as ``cfg`` says (the torch peers bind in
    :func:`bind_rank` and set the policy in :func:`run_peer`)."""
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    if cfg is not None:
        env["ZDSL_BIND_CORES"] = "1" if cfg.bind == "cores" else "0"
        if cfg.loop_policy:
            env["ZDSL_GLOO_LOOP_POLICY"] = cfg.loop_policy
    env["DS_ACCELERATOR"] = env.get("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- running a job without leaving processes behind --------------------------------

def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's children lists), deepest last."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            queue.extend(kids)
    return found


def run_bounded(command: list[str], timeout_s: float, **popen_kwargs) -> int | None:
    """Run ``command``; its exit status, or None when it ran past ``timeout_s``.

    On a timeout (or Ctrl-C) the job is asked to stop (SIGTERM: torchrun and
    ``zdsl run`` pass it on to their ranks), and whatever of it is still alive
    after a grace period is killed by process id. torchrun starts its ranks in
    sessions of their own, so killing the job's process group would miss them;
    the ids are collected from /proc before anything is signalled.
    """
    import subprocess

    proc = subprocess.Popen(command, **popen_kwargs)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc)
        return None
    except BaseException:
        stop_tree(proc)
        raise


def stop_tree(proc, grace_s: float = 15.0) -> None:
    import signal
    import subprocess

    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *family]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
