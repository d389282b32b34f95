"""tests/nemo runs only in the NeMo 2 venv (make test-nemo); the CPU shims are applied before NeMo is imported."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("nemo.collections.llm", reason="NeMo 2 (nemo_toolkit[llm]) is not installed: run make test-nemo")

import cpu_shims  # noqa: E402

cpu_shims.apply()
