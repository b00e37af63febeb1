"""A Hugging Face causal LM fine-tuned in your own loop, under hf_finetune_loop.zs.

Run it with ``torchrun --nproc-per-node 2 programs/hf_finetune_loop.py [--steps N] [--export DIR]``
(the schedule's ``ranks 2``), or ``python programs/hf_finetune_loop.py --ranks 1``. The model is a
transformers instance the script builds; zdsl shards it as the schedule says, ``engine(ids)``
returns its logits, and the loss is the script's own (label smoothing). ``--export DIR`` writes
the trained model as a folder ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers import AutoModelForCausalLM

import zdsl

HERE = Path(__file__).parent
CONTEXT, VOCAB = 32, 256
EPOCH = 2        # batches in the fine-tuning set


def batches(seed, step, micro, rank, world, batch):
    """A rank's batch of counting sequences (each token the one before plus 1, from a random start):
    token ids and the next token of each (the schedule's data)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + rank)
    start = torch.randint(0, VOCAB, (batch, 1), generator=g)
    seq = (start + torch.arange(CONTEXT + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def train(steps: int = 12, export: Path | None = None, ranks: int | None = None) -> list[float]:
    """Fine-tune for ``steps`` steps; the losses (this rank's); the export written where asked.
    ``ranks``: the schedule's ``ranks`` overridden (the world this runs in)."""
    torch.manual_seed(0)    # a folder with weights: AutoModelForCausalLM.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(HERE / "llama"))
    overrides = {} if ranks is None else {"ranks": ranks}
    engine = zdsl.initialize(HERE / "hf_finetune_loop.zs", model=model, overrides=overrides)
    batch = engine.run.schedule.train.batch
    losses = []
    for step in range(steps):
        ids, targets = batches(0, step % EPOCH, 0, engine.rank, engine.world, batch)   # a small set, in turn
        logits = engine(ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), label_smoothing=0.1)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        print(f"rank {engine.rank} step {engine.global_step}: loss {loss.item():.4f} lr {engine.lr:.2e}", flush=True)
    if export is not None:
        engine.export(export, format="hf")
    engine.close()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--export", type=Path, default=None, help="write the trained model here (HF folder)")
    parser.add_argument("--ranks", type=int, default=None, help="the schedule's ranks (1: a plain python run)")
    args = parser.parse_args()
    train(args.steps, args.export, args.ranks)
