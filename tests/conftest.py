"""Shared test set-up. This folder is on the import path (pytest puts a conftest's folder there), so the
helpers beside it (ddp_reference, user_models, work_count) import by name from every test folder."""

import os

import pytest

# The suite plans with zdsl's default machine profile: no test calibrates this machine by accident, reads
# its cached profile or writes one; tests/compiler/test_profile_cache.py turns it on where it tests it.
os.environ["ZDSL_CALIBRATE"] = "0"


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process: a graph's collectives run (and allocate what they write)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
