"""The seeds' DeepSpeed ZeRO-Infinity example, ported line for line to zdsl.

Run it as DeepSpeed's was run, one process per rank::

    torchrun --nproc-per-node 2 programs/deepspeed_seed.py

What changes against the original: ``deepspeed.initialize(model, optimizer, config)`` is
``zdsl.initialize("deepspeed_seed.zs", model=model)`` (the config is the schedule beside this
file; the optimizer is the schedule's ``optimizer`` statement, so no placeholder optimizer);
the data is drawn from a generator seeded by the rank (every rank the same model, its own
batch), on the CPU; ``zero_to_fp32_state_dict`` is ``engine.state_dict()``. ``build`` and
``batches`` are the schedule's model and data (``zdsl check``, ``zdsl plan`` and ``zdsl run``
use them); ``batches`` also gives the script its data.
"""
import torch
import torch.nn as nn
from pathlib import Path

import zdsl


# 定义模型 (the model)
class SimpleModel(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super(SimpleModel, self).__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, output_size)

    def forward(self, x):
        out = self.fc1(x)
        out = self.relu(out)
        out = self.fc2(out)
        return out


# 设置模型参数 (the model's sizes)
input_size = 1000
hidden_size = 1000
output_size = 10


def batches(seed, step, micro, rank, world, batch):
    """A rank's batch: ``batch`` random inputs and class labels, from a generator seeded by the rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(batch, input_size, generator=g), torch.randint(0, output_size, (batch,), generator=g)


def build():
    """The schedule's model: SimpleModel in two units, the loss in the last (``zdsl run`` trains it so)."""
    return zdsl.units(SimpleModel(input_size, hidden_size, output_size), [["fc1", "relu"], "fc2"],
                      loss=nn.CrossEntropyLoss())


def main():
    # 创建模型实例 (every rank builds the same model: DeepSpeed broadcasts rank 0's, zdsl starts from one seed)
    torch.manual_seed(0)
    model = SimpleModel(input_size, hidden_size, output_size)

    # 初始化 (DeepSpeed's config: deepspeed_seed.zs)
    engine = zdsl.initialize(Path(__file__).with_suffix(".zs"), model=model)

    # 准备数据 (the data)
    data, labels = batches(seed=0, step=0, micro=0, rank=engine.rank, world=engine.world, batch=32)

    # 训练模型 (training)
    for i in range(10):
        outputs = engine(data)
        loss = nn.CrossEntropyLoss()(outputs, labels)
        engine.backward(loss)
        engine.step()
        print(f"rank {engine.rank} iteration {i}: loss = {loss.item()!r}", flush=True)

    # 将模型参数转换为FP32格式 (the full fp32 weights, on rank 0)
    state_dict = engine.state_dict()

    # 保存模型 (save them)
    if engine.rank == 0:
        torch.save(state_dict, "simple_model.pth")
    engine.close()
    print(f"rank {engine.rank}: training done")


if __name__ == "__main__":
    main()
