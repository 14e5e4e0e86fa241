import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import their shared tiny components

import torch  # noqa: E402

# Tiny tensors: one thread is faster than several and keeps the suite steady on a busy 2-core machine.
torch.set_num_threads(1)
