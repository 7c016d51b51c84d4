import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter (must be set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def demo_gguf_path():
    """Path of the demo GGUF (fetched into the sluice cache on first use)."""
    from sluice.formats.demo import demo_model_path

    return demo_model_path(quiet=True)
