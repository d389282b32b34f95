"""nemo_spec: speculative decoding (EAGLE-1, EAGLE-3, Medusa) for megatron-core GPT models."""
__version__ = "0.1.0"
