"""Test-wide settings."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter; the variable must be set before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The reference works on tiny tensors: one intra-op thread is faster than two, and much faster
# when the two cores are shared with other work (OpenMP workers spin-wait).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
