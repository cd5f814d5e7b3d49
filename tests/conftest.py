import os

import pytest
import torch

torch.set_num_threads(2)
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
