"""Test setup: Triton kernels run in interpreter mode on CPU (set before any import)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (CI included): a failure found
# once is found again. COMMPRESS_FUZZ_RANDOM=1 explores new examples instead.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("COMMPRESS_FUZZ_RANDOM") == "1"
                      else "reproducible")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
