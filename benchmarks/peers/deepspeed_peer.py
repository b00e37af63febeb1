"""DeepSpeed ZeRO-2 / ZeRO-3 on CPU (``DS_ACCELERATOR=cpu``, gloo), under torchrun.

DeepSpeed is optional (``benchmarks/setup_peers.sh`` installs it); the
orchestrator skips these rows with a message where ``import deepspeed``
fails. The stage comes from ``cfg.extra["stage"]``.

The client optimizer is DeepSpeed's own vectorised ``DeepSpeedCPUAdam`` in
AdamW mode (what a DeepSpeed user on CPU gets); its C++ op is JIT-built on
first use (about a minute, cached after). Where that build fails, or with
``cfg.extra["ds_optimizer"] == "torch"``, it is ``torch.optim.AdamW``. The
result names the one that ran, because a faster optimizer kernel is not a
sharding advantage and the table should say so.

ZeRO settings are DeepSpeed's defaults (buckets, prefetch, the stage-3
parameter persistence threshold), fp32, no gradient clipping, as the other
peers.
"""
from __future__ import annotations

import logging

from benchmarks.peers import adamw, build_model, forward_loss, run_peer


def _optimizer(cfg, model):
    """DeepSpeedCPUAdam if its op builds (and is wanted), else torch AdamW; and its name."""
    choice = cfg.extra.get("ds_optimizer", "auto")
    if choice in ("auto", "cpuadam"):
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay, adamw_mode=True)
            return opt, "DeepSpeedCPUAdam(adamw_mode=True)"
        except Exception as build_failed:          # the JIT op build can fail in many ways
            if choice == "cpuadam":
                raise
            return adamw(cfg, model.parameters()), f"torch.optim.AdamW (DeepSpeedCPUAdam: {build_failed})"
    return adamw(cfg, model.parameters()), "torch.optim.AdamW"


def ds_config(cfg, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg.batch * world,
        "zero_optimization": {"stage": int(cfg.extra.get("stage", 3))},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def setup(cfg, rank, world):
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(cfg)
    optimizer, optimizer_name = _optimizer(cfg, model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cfg, world))
    loss_of = forward_loss(cfg)

    def step(tokens, targets):
        loss = loss_of(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, dict(wrapper=f"deepspeed.initialize ZeRO-{ds_config(cfg, world)['zero_optimization']['stage']}",
                      optimizer=optimizer_name, deepspeed=deepspeed.__version__)


if __name__ == "__main__":
    run_peer("deepspeed", setup)
