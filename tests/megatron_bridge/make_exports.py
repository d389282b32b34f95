"""Write Megatron Bridge checkpoints with Megatron Bridge 0.3.1's own code (run in its side environment, make
test-megatron-bridge): tiny GPTs built by its model providers (LlamaModelProvider: untied, tied, Llama 3.1 RoPE
scaling; Qwen3ModelProvider: QK layer norm), saved by ``training/model_load_save.py save_megatron_model`` (->
``training/checkpointing.py save_checkpoint``, torch_dist), each with the logits of Bridge's own forward (fp32).

Also, with Bridge's own code: a LoRA fine-tune's checkpoint (``training/checkpointing.py save_checkpoint`` with
``cfg.peft`` set: adapter weights only) and a checkpoint whose tokenizer assets are a TikTokenizer's
(``save_tokenizer_assets``).

Usage: python make_exports.py OUT_DIR    (OUT_DIR/<name>/ checkpoints, OUT_DIR/reference.pt)

Bridge needs a GPU to run as shipped; what this driver changes to run it on CPU, none of which changes what is
written (the RNG state it stubs is not saved: save_rng is off in save_megatron_model):
  1. import time: ``import megatron.bridge`` reaches peft/lora_layers.py:20 ``import transformer_engine.pytorch``
     (megatron/bridge/__init__.py -> models -> conversion.auto_bridge -> ... -> lora_layers); a stub module stands in
     for transformer_engine only while megatron.bridge imports (megatron-core is imported first and keeps
     HAVE_TE=False, so every layer is megatron-core's local implementation);
  2. run time: torch.cuda.get_rng_state (checkpointing.py:407, unconditional), current_device and synchronize
     (dist_checkpointing) answer for the CPU; the model-parallel CUDA RNG tracker forks only registered states;
     the reference forward passes an explicit causal mask (megatron-core builds its default one on cuda);
  3. LoRA: megatron.bridge.peft's HAVE_TE flags, set while the stub stood in, are reset to False (no Transformer
     Engine layers exist to wrap).
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings
from pathlib import Path


def _import_bridge():
    import torch

    import megatron.core  # noqa: F401  - first, so megatron-core records Transformer Engine as absent
    import megatron.core.extensions  # noqa: F401
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401

    class _Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Meta(name, (torch.nn.Module,), {})

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Meta(name, (torch.nn.Module,), {})

    stubs = {n: _Stub(n) for n in ("transformer_engine", "transformer_engine.pytorch")}
    stubs["transformer_engine"].pytorch = stubs["transformer_engine.pytorch"]
    sys.modules.update(stubs)
    try:
        from megatron.bridge.models.gpt_provider import local_layer_spec
        from megatron.bridge.models.llama.llama_provider import LlamaModelProvider
        from megatron.bridge.models.qwen.qwen_provider import Qwen3ModelProvider
        from megatron.bridge.training.model_load_save import save_megatron_model
        import megatron.bridge.peft.lora  # noqa: F401  (imports Transformer Engine at import time too)
    finally:
        for n in stubs:
            del sys.modules[n]
    return LlamaModelProvider, Qwen3ModelProvider, local_layer_spec, save_megatron_model


def _cpu_runtime():
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    fork = mrandom.CudaRNGStatesTracker.fork

    def _fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        return fork(self, name) if name in self.states_ else contextlib.nullcontext()

    mrandom.CudaRNGStatesTracker.fork = _fork


def _tokenizer(out: Path) -> Path:
    """A small HF tokenizer directory for Bridge's save_tokenizer_assets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["the cat sat on the mat and the dog sat on the log"] * 20,
                            trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return out


def _lora_checkpoint(out: Path, provider) -> None:
    """A LoRA fine-tune's checkpoint as Bridge's save_checkpoint writes it (cfg.peft set: the adapters only)."""
    import megatron.bridge.peft.lora as bridge_lora
    import megatron.bridge.peft.utils as bridge_peft_utils
    from megatron.bridge.training.checkpointing import save_checkpoint
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.core.optimizer import OptimizerConfig

    for mod in (bridge_peft_utils, bridge_lora):
        if hasattr(mod, "HAVE_TE"):
            mod.HAVE_TE = False
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                               mixed_precision_wrapper=None)
    lora = bridge_lora.LoRA(target_modules=["linear_qkv", "linear_proj"], dim=4, alpha=8)
    model = lora(model, training=True)
    state = GlobalState()
    state.cfg = ConfigContainer(
        model=provider, train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False), ddp=None,
        scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=None, peft=lora,
        checkpoint=CheckpointConfig(async_save=False, save=str(out), save_optim=False, save_rng=False,
                                    ckpt_format="torch_dist", pretrained_checkpoint="/ckpt/llama_base"))
    state.train_state.step = 100
    save_checkpoint(state=state, model=model, optimizer=None, opt_param_scheduler=None,
                    num_floating_point_operations_so_far=0)
    print("llama_lora: saved (LoRA adapters only)", flush=True)


def _tiktoken_assets(src: Path, out: Path, provider) -> None:
    """``src``'s weights with what save_checkpoint writes besides them for a run with a TikTokenizer: the run config
    (cfg.to_yaml) and the tokenizer assets (save_tokenizer_assets: the vocabulary goes to ``tokenizer/tokenizer.json``,
    a list of {rank, token_bytes, token_str}, not a Hugging Face tokenizer.json)."""
    import base64
    import json
    import shutil

    from megatron.bridge.training.checkpointing import save_tokenizer_assets
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.optimizer import OptimizerConfig

    shutil.copytree(src, out)
    vocab = out.parent / "tiktoken_vocab.json"
    vocab.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(),
                                  "token_str": chr(i)} for i in range(256)]))
    tok = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(vocab))
    cfg = ConfigContainer(model=provider, train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False),
                          ddp=None, scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=tok,
                          checkpoint=CheckpointConfig(save=str(out), ckpt_format="torch_dist"))
    cfg.to_yaml(str(out / "iter_0000000" / "run_config.yaml"))
    save_tokenizer_assets(object(), tok, str(out / "iter_0000000"))
    print("llama_tiktoken: tokenizer assets", sorted(p.name for p in (out / "iter_0000000" / "tokenizer").iterdir()),
          flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    Llama, Qwen3, local_layer_spec, save_megatron_model = _import_bridge()
    _cpu_runtime()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu = dict(transformer_layer_spec=local_layer_spec, bias_activation_fusion=False, apply_rope_fusion=False,
               masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
               bias_dropout_fusion=False, cross_entropy_loss_fusion=False, attention_backend="local",
               params_dtype=torch.float32, bf16=False, fp16=False)
    shape = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 vocab_size=128, seq_length=64, init_method_std=0.2)
    tok_dir = _tokenizer(out / "hf_tokenizer")
    cases = {
        "llama": (Llama, dict(rotary_base=500000, share_embeddings_and_output_weights=False), True),
        "llama_tied": (Llama, dict(share_embeddings_and_output_weights=True), False),
        "llama31_rope": (Llama, dict(rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
                                     share_embeddings_and_output_weights=False), False),
        "qwen3": (Qwen3, dict(kv_channels=16, share_embeddings_and_output_weights=False), False),
    }
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 12))
    mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), diagonal=1)  # True = masked
    ref = {"tokens": tokens}
    for name, (cls, kw, with_tok) in cases.items():
        torch.manual_seed(0)
        provider = cls(**shape, **kw, **cpu)
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                   mixed_precision_wrapper=None)
        m = model[0].eval()
        with torch.no_grad():  # norms away from 1, so a mis-mapped norm shows in the logits
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.randn_like(p))
            logits = m(tokens, torch.arange(12).unsqueeze(0).expand(2, -1), attention_mask=mask)
        save_megatron_model(model, str(out / name), ckpt_format="torch_dist",
                            hf_tokenizer_path=str(tok_dir) if with_tok else None)
        ref[name] = {"logits": logits.float(), "provider": f"{cls.__module__}.{cls.__name__}"}
        print(f"{name}: saved ({ref[name]['provider']}), logits {tuple(logits.shape)}", flush=True)
    _lora_checkpoint(out / "llama_lora", Llama(**shape, **cpu))
    _tiktoken_assets(out / "llama_tied", out / "llama_tiktoken",
                     Llama(**shape, **cases["llama_tied"][1], **cpu))
    torch.save(ref, out / "reference.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager (spawn)
    main()
