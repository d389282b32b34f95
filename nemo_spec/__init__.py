"""nemo_spec: speculative decoding (EAGLE-1, EAGLE-3, Medusa) for megatron-core GPT models."""
from typing import Any

__version__ = "0.1.0"

__all__ = ["SpeculativeTransform", "__version__"]


def __getattr__(name: str) -> Any:
    """Lazy exports (importing nemo_spec stays cheap: megatron-core loads on first use)."""
    if name == "SpeculativeTransform":
        from nemo_spec.speculative import SpeculativeTransform

        return SpeculativeTransform
    raise AttributeError(f"module 'nemo_spec' has no attribute {name!r}")
