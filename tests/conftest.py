"""Test-wide settings."""

import torch

# The reference works on tiny tensors: one intra-op thread is faster than two, and much faster
# when the two cores are shared with other work (OpenMP workers spin-wait).
torch.set_num_threads(1)
