"""``scripts/export.py``: export a saved checkpoint (base + draft) to serving formats.

Single process or under ``torchrun --nproc_per_node N`` (the checkpoint is loaded at TP = ``--tp_size``, default
the world size / ``--ep_size``, and a MoE base at EP = ``--ep_size``, whatever TP/EP it was saved with; rank 0
writes).
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Optional, Sequence

from nemo_spec.export import FORMATS, export_checkpoint
from nemo_spec.export.engines import TARGETS
from nemo_spec.export.formats import DTYPES, ExportError
from nemo_spec.entry import debug_requested, print_user_error

log = logging.getLogger("nemo_spec.export")


def build_parser() -> argparse.ArgumentParser:
    """Command-line arguments of scripts/export.py."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", "--model_path", dest="checkpoint", required=True,
                   help="nemo_spec torch_dist checkpoint (e.g. from gpt_speculate.py or training)")
    p.add_argument("--export_dir", required=True, help="output directory (base/, draft/, README.md)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="draft format; auto = the checkpoint's draft algorithm (base only if untransformed)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of exported floating tensors")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty export_dir")
    p.add_argument("--no_base", action="store_true", help="write only the draft (no base/ HF directory)")
    p.add_argument("--base_name", default=None,
                   help="base_model_name_or_path recorded in the draft config (default: export_dir/base)")
    p.add_argument("--target", default="all", choices=list(TARGETS),
                   help="serving engine the draft is laid out for; all = draft/<engine>/ for every engine")
    p.add_argument("--no_verify", action="store_true",
                   help="skip reading the export back through every engine's conformance reader")
    p.add_argument("--tp_size", type=int, default=None,
                   help="tensor-parallel size to load at (default: world size / ep_size)")
    p.add_argument("--ep_size", type=int, default=None, help="expert-parallel size of a MoE base (default 1)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code (2 on a user error, with a one-line message)."""
    import torch.distributed as dist

    from nemo_spec import parallel
    from nemo_spec.checkpoint import CheckpointError
    from nemo_spec.config import ConfigError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    owns = not dist.is_initialized()
    try:
        ep = args.ep_size or 1
        tp = args.tp_size or max(1, int(os.environ.get("WORLD_SIZE", "1")) // ep)
        parallel.initialize(tensor_parallel_size=tp, expert_parallel_size=ep)
        out = export_checkpoint(args.checkpoint, args.export_dir, fmt=args.format, dtype=args.dtype,
                                overwrite=args.overwrite, include_base=not args.no_base, base_name=args.base_name,
                                target=args.target, verify=not args.no_verify)
        if parallel.is_rank_zero():
            log.info("export written to %s (see %s)", out, out / "README.md")
    except (ExportError, CheckpointError, ConfigError, ValueError) as e:
        if debug_requested():
            raise
        print_user_error(e)
        return 2
    finally:
        if owns:
            parallel.destroy()
    return 0


def build_verify_parser() -> argparse.ArgumentParser:
    """Command-line arguments of scripts/verify_export.py."""
    p = argparse.ArgumentParser(description="Read an export back through every engine's conformance reader and "
                                            "compare its draft (and base) logits with the checkpoint")
    p.add_argument("export_dir", help="an export directory (export_info.json, base/, draft/...)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint the export was made from")
    p.add_argument("--engines", default=None, help="comma-separated subset of engines (default: all exported)")
    p.add_argument("--num_inputs", type=int, default=2, help="random token sequences to compare on")
    p.add_argument("--seq_len", type=int, default=9, help="length of each sequence")
    p.add_argument("--atol", type=float, default=1e-3, help="max |logit difference| for fp32 exports")
    return p


def verify_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of scripts/verify_export.py: prints the table; 1 on any mismatch, 2 on a user error."""
    from nemo_spec import parallel
    from nemo_spec.checkpoint import CheckpointError
    from nemo_spec.export.engines import format_table, rows_ok, verify_export

    import torch.distributed as dist

    args = build_verify_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    owns = not dist.is_initialized()  # called in-process (tests, notebooks): leave the caller's parallel state
    if owns:
        parallel.initialize(tensor_parallel_size=1)
    try:
        engines = args.engines.split(",") if args.engines else None
        rows = verify_export(args.export_dir, checkpoint=args.checkpoint, num_inputs=args.num_inputs,
                             seq_len=args.seq_len, atol=args.atol, engines=engines)
    except (ExportError, CheckpointError, ValueError) as e:
        if debug_requested():
            raise
        print_user_error(e)
        return 2
    finally:
        if owns:
            parallel.destroy()
    print(format_table(rows))
    return 0 if rows_ok(rows) else 1
