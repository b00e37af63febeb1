"""torch FSDP2: ``fully_shard`` on every block, then on the root (ZeRO-3 in torch).

Each block (a GPT block, a Llama decoder layer) is its own all-gather /
reduce-scatter group, as the FSDP2 docs recommend; the root group holds the
embedding, the final norm and the head, so the GPT's tied ``wte.weight``
lives in one group. Runs on CPU over gloo. Where
this torch's FSDP2 refuses plain CPU parameters, it falls back to
``CPUOffloadPolicy`` (parameters and optimizer state on the host; on a CPU-only
machine the same memory), and the result says which one ran.
"""
from __future__ import annotations

from benchmarks.peers import adamw, blocks, build_model, plain_step, run_peer


def _shard(cfg, model, mesh, offload: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in blocks(cfg, model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def setup(cfg, rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    try:
        model, policy = _shard(cfg, build_model(cfg), mesh, offload=False), "none"
    except (RuntimeError, ValueError, AssertionError) as plain_cpu_refused:
        model, policy = _shard(cfg, build_model(cfg), mesh, offload=True), \
            f"CPUOffloadPolicy (plain CPU refused: {plain_cpu_refused})"
    optimizer = adamw(cfg, model.parameters())

    return plain_step(cfg, model, optimizer), dict(wrapper="fully_shard per block + root", offload=policy,
                      optimizer="torch.optim.AdamW")


if __name__ == "__main__":
    run_peer("fsdp2", setup)
