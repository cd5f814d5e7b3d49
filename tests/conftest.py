import os

import pytest
import torch

# under pytest-xdist (`make test` runs two workers) each worker takes one core
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
if not torch.cuda.is_available():
    # Triton kernels run under its CPU interpreter here. Triton reads this once, when it is first imported,
    # and other modules (torch among them) may import it before the kernel tests do.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
