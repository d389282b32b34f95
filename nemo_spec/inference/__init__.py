"""Inference: KV-cached batched generation, lossless speculative sampling (EAGLE, Medusa, draft model, prompt lookup)."""
from nemo_spec.inference.engine import GenerationResult
from nemo_spec.inference.generate import generate, get_engine
from nemo_spec.inference.sampling import SamplingError, SamplingParams, sample, warp_logits
from nemo_spec.inference.proposers import METHODS
from nemo_spec.inference.session import Session

__all__ = ["GenerationResult", "METHODS", "SamplingError", "SamplingParams", "Session", "generate", "get_engine",
           "sample", "warp_logits"]
