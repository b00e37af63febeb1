"""A Hugging Face model in the user's loop at 2 ranks, ZeRO-3, against DDP with the same loop.

Each rank feeds its own batch and computes its own next-token loss from the logits; DDP trains
the same instance (copied before) on the same batches with torch's AdamW as the schedule names
it. Per-rank losses and the final weights must agree to the bit: at 2 ranks ZeRO-3's
reduce-scatter and DDP's all-reduce add the two gradients in the same order.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ddp_reference import spawn  # noqa: E402
from test_hf_loop import CONTEXT, ROWS, SCHEDULE, VOCAB, next_token_loss, tiny  # noqa: E402

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'
STEPS = 3


def rank_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g) for _ in range(STEPS)]


def api_and_ddp(rank: int, world: int, folder: str) -> tuple:
    import zdsl
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zdsl.runtime.checkpoint.export_hf import hf_names_by_key
    from zdsl.runtime.state.optim import make_torch_optimizer
    model = tiny("gpt2")
    reference = copy.deepcopy(model)
    zs = Path(folder) / "hf2.zs"
    if rank == 0:
        zs.write_text(SCHEDULE.replace("ranks     1", "ranks     2"))
    torch.distributed.barrier()
    mine = []
    with zdsl.initialize(zs, model=model) as engine:
        for ids in rank_batches(rank):
            loss = next_token_loss(engine(ids), ids)
            engine.backward(loss)
            engine.step()
            mine.append(loss.item())
        optimizer = engine.run.graph.config["optimizer"]
        names = hf_names_by_key(engine.run.model)
        weights = {names[k]: v for k, v in engine.state_dict().items()}
    ddp, ref = DDP(reference), []
    opt = make_torch_optimizer(reference.parameters(), optimizer)
    for ids in rank_batches(rank):
        loss = next_token_loss(ddp(ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(loss.item())
    return mine, ref, weights, {k: v.detach().clone() for k, v in reference.named_parameters()}


def test_an_hf_model_at_two_ranks_zero3_equals_ddp(tmp_path):
    results = spawn(api_and_ddp, 2, str(tmp_path))
    for rank, (mine, ref, weights, ref_weights) in enumerate(results):
        assert mine == ref, f"rank {rank}"
        if rank == 0:
            assert set(weights) <= set(ref_weights) and weights
            for name, value in weights.items():
                assert torch.equal(value, ref_weights[name]), name
    assert results[0][0] != results[1][0]       # each rank its own batch
