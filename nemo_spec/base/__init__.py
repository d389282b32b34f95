"""The built-in base model: a BPE tokenizer and a small Llama-style GPT pretrained on the local stdlib source."""
from nemo_spec.base.build import BaseModel, BuildError, build_base, ensure_base, resolve_cache_dir
from nemo_spec.base.corpus import Corpus, CorpusError, heldout_prompts, heldout_samples, load_corpus
from nemo_spec.base.presets import BasePreset, load_preset

__all__ = ["BaseModel", "BuildError", "build_base", "ensure_base", "resolve_cache_dir", "Corpus", "CorpusError",
           "heldout_prompts", "heldout_samples", "load_corpus", "BasePreset", "load_preset"]
