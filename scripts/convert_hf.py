#!/usr/bin/env python
"""Convert between Hugging Face directories / llama.cpp GGUF files and nemo_spec (Megatron torch_dist) checkpoints.

  python scripts/convert_hf.py import HF_DIR CKPT_DIR            # HF -> torch_dist (+ tokenizer, config)
  python scripts/convert_hf.py import MODEL.gguf CKPT_DIR        # GGUF (dequantized) -> torch_dist (+ tokenizer)
  python scripts/convert_hf.py export CKPT_DIR HF_DIR --dtype bf16   # torch_dist / legacy / HF -> HF
  torchrun --nproc_per_node 2 scripts/convert_hf.py import HF_DIR CKPT_DIR --tp 2
  torchrun --nproc_per_node 2 scripts/convert_hf.py import MOE_HF_DIR CKPT_DIR --ep 2   # experts over 2 EP ranks
"""
import argparse
import logging
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec import parallel
from nemo_spec.checkpoint import gguf, hf


def main(argv=None) -> int:
    """Parse arguments, set up the parallel state, convert, return the exit code."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["import", "export"], help="import: HF -> torch_dist; export: -> HF")
    ap.add_argument("src", help="source directory (import: or a .gguf file)")
    ap.add_argument("dst", help="destination directory (written atomically)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (run under torchrun when > 1)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size of a MoE model (TP x EP must divide the "
                    "world size)")
    ap.add_argument("--dtype", default="fp32", help="export: fp32 | bf16 | fp16; import: the parameter dtype of a "
                    "GGUF import (HF imports keep fp32 parameters)")
    ap.add_argument("--tokenizer_dir", default=None, help="export: tokenizer files to copy (default: from src); "
                    "GGUF import: a Hugging Face tokenizer directory saved in place of the one rebuilt from the file")
    ap.add_argument("--architecture", default=None, choices=sorted(hf.SUPPORTED_ARCHITECTURES),
                    help="export: HF architecture to write (default: derived from the model config)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty destination (export: an earlier "
                    "HF export; import: an earlier checkpoint)")
    args = ap.parse_args(argv)
    gguf_import = args.direction == "import" and (gguf.is_gguf_file(args.src) or args.src.lower().endswith(".gguf"))
    if args.direction == "import" and args.tokenizer_dir and not gguf_import:
        ap.error("--tokenizer_dir is for exports and GGUF imports; a Hugging Face import saves the tokenizer of its "
                 "directory")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parallel.initialize(tensor_parallel_size=args.tp, expert_parallel_size=args.ep)
    try:
        if gguf_import:
            out = gguf.convert_gguf_to_checkpoint(args.src, args.dst, params_dtype=hf.resolve_dtype(args.dtype),
                                                  overwrite=args.overwrite, tokenizer_dir=args.tokenizer_dir)
        elif args.direction == "import":
            out = hf.convert_hf_to_checkpoint(args.src, args.dst, overwrite=args.overwrite)
        else:
            out = hf.convert_checkpoint_to_hf(args.src, args.dst, dtype=args.dtype, tokenizer_dir=args.tokenizer_dir,
                                              architecture=args.architecture, overwrite=args.overwrite)
    except (hf.HFCheckpointError, gguf.GGUFError, ValueError, FileNotFoundError) as e:
        if entry.debug_requested():
            raise
        entry.print_user_error(e)
        return 2
    finally:
        parallel.destroy()
    logging.getLogger("convert_hf").info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
