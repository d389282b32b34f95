"""`gpt_speculate`: load a base checkpoint, attach a speculative draft, save a Megatron distributed checkpoint.

Runs single-process or under ``torchrun --nproc_per_node N`` (tensor parallel ``--tp_size``). All argument and
architecture checks happen before any weights are loaded.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from nemo_spec.config import ALGORITHMS, ConfigError, ModelConfig, SpeculativeConfig
from nemo_spec.entry import debug_requested, print_user_error

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of scripts/gpt_speculate.py."""
    p = argparse.ArgumentParser(
        prog="gpt_speculate.py",
        description="Attach an EAGLE-1 / EAGLE-3 / Medusa draft to a GPT checkpoint and save it as a Megatron "
                    "distributed checkpoint (the saved config records the speculative config).")
    p.add_argument("--model_path", required=True,
                   help="base checkpoint: nemo_spec/Megatron torch_dist dir, Megatron-LM legacy dir, or Hugging Face dir")
    p.add_argument("--export_dir", required=True, help="output checkpoint directory (must not exist unless --overwrite)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                   help="draft algorithm; without it the NeMo spelling applies (num_eagle_layers>0 -> eagle3)")
    p.add_argument("--num_eagle_layers", type=int, default=None, help="EAGLE draft decoder layers")
    p.add_argument("--num_medusa_heads", type=int, default=None, help="Medusa heads")
    p.add_argument("--num_medusa_layers", type=int, default=None, help="residual blocks per Medusa head (default 1)")
    p.add_argument("--draft_vocab_size", type=int, default=None, help="EAGLE-3 draft vocabulary size (default: base vocab)")
    p.add_argument("--aux_layers", type=str, default=None,
                   help="EAGLE-3 base layers feeding the draft, comma separated 0-based (default low/mid/high)")
    p.add_argument("--ttt_steps", type=int, default=None, help="EAGLE-3 training-time-test unroll depth (default 3)")
    p.add_argument("--block_size", type=int, default=None, help="DFlash block size B (B - 1 drafts per step; default 16)")
    p.add_argument("--target_layer_ids", type=str, default=None,
                   help="DFlash base layers fused into the draft, comma separated 0-based (default: the reference's)")
    p.add_argument("--mask_token_id", type=int, default=None,
                   help="P-EAGLE / DFlash mask placeholder id (default: pad id, else vocab_size - 1)")
    for name, what in (("norm_before_fc", "an RMSNorm over the base features before fc"),
                       ("norm_before_residual", "layer 0's residual is the normalised feature"),
                       ("norm_output", "the normalised draft output is the next step's feature")):
        p.add_argument(f"--{name}", action="store_true", default=None,
                       help=f"EAGLE-3, vLLM speculators option: {what}")
    p.add_argument("--token_counts", type=str, default=None,
                   help="EAGLE-3: token frequencies (.pt tensor or JSON list, length = base vocab) used to pick the "
                        "draft vocabulary (most frequent tokens); default: the first draft_vocab_size ids")
    p.add_argument("--tp_size", type=int, default=None, help="tensor-parallel size (default: world size / ep_size)")
    p.add_argument("--ep_size", type=int, default=None, help="expert-parallel size of a MoE base (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --export_dir")
    return p


def _parse_aux(text: Optional[str], flag: str = "--aux_layers") -> Optional[List[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from e


def _load_counts(path: str, vocab_size: int) -> torch.Tensor:
    """Token counts from a .pt tensor or a JSON list."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--token_counts {path}: no such file")
    try:
        if p.suffix == ".json":
            counts = torch.tensor(json.loads(p.read_text()), dtype=torch.float64)
        else:
            counts = torch.as_tensor(torch.load(p, map_location="cpu", weights_only=True), dtype=torch.float64)
    except Exception as e:  # noqa: BLE001 - unreadable JSON / pickle, or values that are not numbers
        kind = "a JSON list of numbers" if p.suffix == ".json" else "a torch.save'd 1-D tensor"
        raise ConfigError(f"--token_counts {path}: not {kind} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if counts.ndim != 1 or counts.numel() != vocab_size:
        raise ConfigError(f"--token_counts {path}: expected {vocab_size} counts, got shape {tuple(counts.shape)}")
    return counts


def speculate(model_path: str, export_dir: str, algorithm: Optional[str] = None,
              num_eagle_layers: Optional[int] = None, num_medusa_heads: Optional[int] = None,
              num_medusa_layers: Optional[int] = None, draft_vocab_size: Optional[int] = None,
              aux_layers: Optional[List[int]] = None, ttt_steps: Optional[int] = None,
              token_counts: Optional[str] = None, tp_size: Optional[int] = None, overwrite: bool = False,
              ep_size: Optional[int] = None, block_size: Optional[int] = None,
              target_layer_ids: Optional[List[int]] = None, mask_token_id: Optional[int] = None,
              norm_before_fc: Optional[bool] = None, norm_before_residual: Optional[bool] = None,
              norm_output: Optional[bool] = None) -> Path:
    """Load ``model_path``, apply SpeculativeTransform, save to ``export_dir``; returns the checkpoint path."""
    import torch.distributed as dist

    from nemo_spec import parallel
    from nemo_spec.checkpoint import find_tokenizer_dir, load_model, read_checkpoint_config, save_checkpoint
    from nemo_spec.speculative import SpeculativeGPT, SpeculativeTransform

    transform = SpeculativeTransform(algorithm=algorithm, num_eagle_layers=num_eagle_layers,
                                     num_medusa_heads=num_medusa_heads, num_medusa_layers=num_medusa_layers,
                                     draft_vocab_size=draft_vocab_size, aux_layers=aux_layers, ttt_steps=ttt_steps,
                                     block_size=block_size, target_layer_ids=target_layer_ids,
                                     mask_token_id=mask_token_id, norm_before_fc=norm_before_fc,
                                     norm_before_residual=norm_before_residual, norm_output=norm_output)
    out = Path(export_dir).expanduser().absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"--export_dir {out} already exists; pass --overwrite to replace it")
    if token_counts is not None and transform.config.algorithm != "eagle3":
        raise ConfigError(f"--token_counts is only used by eagle3, not {transform.config.algorithm}")
    cfg_dict = read_checkpoint_config(model_path)
    model_cfg = ModelConfig.from_dict(cfg_dict["model"], source=f"{model_path}: model config")
    world = dist.get_world_size() if dist.is_initialized() else int(__import__("os").environ.get("WORLD_SIZE", "1"))
    ep = ep_size or 1
    tp = tp_size or max(1, world // ep)
    transform.validate_for(model_cfg, tp)  # draft vs base architecture, TP divisibility: before loading weights
    model_cfg.check_expert_parallel(ep)
    counts = _load_counts(token_counts, model_cfg.vocab_size) if token_counts is not None else None
    base_only = False
    if cfg_dict.get("speculative"):  # a checkpoint that already carries a draft (ours, or one trained through NeMo)
        old = SpeculativeConfig.from_dict(cfg_dict["speculative"], source=f"{model_path}: speculative config")
        why = transform.conflict(old, model_cfg, tp)
        if why:  # attaching another draft is what this script is for: the checkpoint's base gets the new one
            log.warning("%s: %s; the new draft is attached to the checkpoint's base instead (its %s draft is not "
                        "carried over)", model_path, why, old.algorithm)
            base_only = True
    parallel.initialize(tensor_parallel_size=tp, expert_parallel_size=ep)
    log.info("loading %s (tp=%d, ep=%d)", model_path, tp, ep)
    model = load_model(model_path, tp_size=tp, ep_size=ep, base_only=base_only)
    model = transform(model)
    if not isinstance(model, SpeculativeGPT):
        raise TypeError(f"expected a SpeculativeGPT after the transform, got {type(model).__name__}")
    if counts is not None:
        model.set_draft_vocab(counts)
    elif model.algorithm == "eagle3" and model.draft_vocab_size < model_cfg.vocab_size:
        log.warning("EAGLE-3 draft vocabulary = the first %d token ids; pass --token_counts (or call "
                    "set_draft_vocab with training-data frequencies) for a frequency-based vocabulary",
                    model.draft_vocab_size)
    tok = find_tokenizer_dir(model_path)
    path = save_checkpoint(model, out, tokenizer_dir=tok, extra={"speculate_source": str(model_path)},
                           overwrite=overwrite)
    log.info("saved %s draft (%d draft parameters per rank) to %s", model.algorithm, model.num_draft_parameters(), path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse arguments, run :func:`speculate`; exit code 2 on configuration errors."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    import torch.distributed as dist

    from nemo_spec import parallel
    from nemo_spec.checkpoint import CheckpointError

    owns_parallel_state = not dist.is_initialized()

    try:
        speculate(args.model_path, args.export_dir, algorithm=args.algorithm, num_eagle_layers=args.num_eagle_layers,
                  num_medusa_heads=args.num_medusa_heads, num_medusa_layers=args.num_medusa_layers,
                  draft_vocab_size=args.draft_vocab_size, aux_layers=_parse_aux(args.aux_layers),
                  ttt_steps=args.ttt_steps, token_counts=args.token_counts, tp_size=args.tp_size,
                  overwrite=args.overwrite, ep_size=args.ep_size, block_size=args.block_size,
                  target_layer_ids=_parse_aux(args.target_layer_ids, "--target_layer_ids"),
                  mask_token_id=args.mask_token_id, norm_before_fc=args.norm_before_fc,
                  norm_before_residual=args.norm_before_residual, norm_output=args.norm_output)
    except (ConfigError, CheckpointError, FileExistsError) as e:  # one line, as every script's user errors
        if debug_requested():
            raise
        print_user_error(e)
        return 2
    finally:
        if owns_parallel_state:
            parallel.destroy()
    return 0
