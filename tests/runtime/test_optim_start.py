"""A rank's optimizer starts without torch._dynamo: torch wraps Optimizer's bookkeeping methods in
a lazy import of it (about 2 s of a small run's start), which zdsl's optimizers leave out."""
import subprocess
import sys

import torch

from zdsl.runtime.state.optim import UnitOptimizer, make_torch_optimizer

BUILD_AND_STEP = """
import sys, torch
from zdsl.runtime.state.optim import UnitOptimizer
opt = UnitOptimizer({"kind": "adamw", "lr": 1e-2, "weight_decay": 0.1}, [(0, 6), (6, 10)], master=False,
                    decay=[(0, 6)])
flat = torch.zeros(opt.flat_numel)
params = [torch.ones(6), torch.ones(4)]
opt.step(flat, params, [torch.full((6,), 0.5), torch.full((4,), -0.5)])
opt.set_lr(1e-3)
assert opt.steps == 1 and not torch.equal(params[0], torch.ones(6)), (opt.steps, params)
print("torch._dynamo" in sys.modules)
"""


def test_a_unit_optimizer_builds_and_steps_on_the_host_without_importing_torch_dynamo():
    proc = subprocess.run([sys.executable, "-c", BUILD_AND_STEP], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"


def test_the_optimizers_are_torchs_classes_with_the_same_groups_and_state():
    adam = dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    for kind, cls, kw in (("adamw", torch.optim.AdamW, adam), ("adam", torch.optim.Adam, adam),
                          ("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1))):
        ours = make_torch_optimizer([torch.nn.Parameter(torch.ones(3))], {"kind": kind, **kw})
        assert isinstance(ours, cls) and type(ours).__name__ == cls.__name__
        p = torch.nn.Parameter(torch.ones(3))
        theirs = cls([p], **kw)
        ours.param_groups[0]["params"][0].grad = p.grad = torch.full((3,), 0.25)
        ours.step()
        theirs.step()
        assert torch.equal(ours.param_groups[0]["params"][0], p)
        state = ours.state_dict()
        ours.load_state_dict(state)
        ours.zero_grad()
        assert ours.param_groups[0]["params"][0].grad is None
        assert state["param_groups"][0].keys() == theirs.state_dict()["param_groups"][0].keys()
