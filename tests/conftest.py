import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import their shared tiny components

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny tensors: one thread is faster than several and keeps the suite steady on a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Scripts run in-process (benchmarks, training) set their own thread count; put it back after each test,
    so results that must match bit for bit (threads vs alone) never depend on test order."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def model_calls(pipe) -> list:
    """One entry per call of the module's `pipe` transformer: proof that no work was done."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    yield calls
    handle.remove()
