"""torch DDP: every rank holds the whole model, gradients are all-reduced.

The baseline the others are held against: the loss each later system reaches
should equal DDP's (same init, same batches, same AdamW), and zdsl stages 1
and 2 should be no slower. DDP is used as a user gets it (default buckets).
"""
from __future__ import annotations

from benchmarks.peers import adamw, build_model, plain_step, run_peer


def setup(cfg, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(cfg))
    optimizer = adamw(cfg, model.parameters())

    return plain_step(cfg, model, optimizer), dict(wrapper="DistributedDataParallel", optimizer="torch.optim.AdamW")


if __name__ == "__main__":
    run_peer("ddp", setup)
