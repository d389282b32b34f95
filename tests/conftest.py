"""Shared fixtures: one single-process megatron parallel state (TP=1, gloo) for the whole session."""
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the fast path's small-row CPU kernel is chosen by timing by default (models/fastpath.py); the two kernels can
# differ in the last bits, so tests (and the torchrun scripts they start) pin one for bit-reproducible runs;
# tests/test_models.py checks the timed choice itself
os.environ.setdefault("NEMO_SPEC_SMALL_GEMM", "linear")
torch.set_num_threads(1)  # tiny test models: one thread beats two


@pytest.fixture(scope="session", autouse=True)
def _parallel_state():
    from nemo_spec import parallel

    parallel.initialize(tensor_parallel_size=1)
    yield
    parallel.destroy()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
