"""Command-line generation: prompts from arguments, a file or stdin; streams text; prints stats (scripts/generate.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, TextIO

from nemo_spec.fsutil import write_text_atomic
from nemo_spec.inference.sampling import SamplingError, SamplingParams, continuation_text
from nemo_spec.inference.proposers import METHODS

log = logging.getLogger(__name__)


COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def _bare_compile(argv: Sequence[str]) -> List[str]:
    """``--compile`` followed by a prompt (not a mode) means the default mode: argparse would otherwise take the
    prompt as the mode and refuse it (`generate.py --model M --compile "def f():"`)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--compile" and out[i + 1] not in COMPILE_MODES and not out[i + 1].startswith("-"):
            out.insert(i + 1, "default")
            break
    return out


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of scripts/generate.py."""
    p = argparse.ArgumentParser(description="Generate text with a nemo_spec / Megatron / Hugging Face checkpoint, "
                                            "optionally with speculative decoding.")
    p.add_argument("prompts", nargs="*", help="prompt texts ('-' or none: read prompts from stdin, one per line)")
    p.add_argument("--model", required=True, help="checkpoint directory (nemo_spec torch_dist, Megatron-LM or HF)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir/file (default: the checkpoint's tokenizer)")
    p.add_argument("--prompt-file", default=None,
                   help="file with one prompt per line, or JSONL with a 'prompt' field per line")
    p.add_argument("--method", default="ar", choices=METHODS)
    p.add_argument("--draft-model", default=None, help="checkpoint of the smaller draft GPT (method draft_model)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft length (eagle chain, draft_model, prompt_lookup, peagle, dflash; suffix: most tree "
                        "nodes)")
    p.add_argument("--adaptive", action="store_true",
                   help="choose each step's draft length / tree size (down to none) from measured costs and "
                        "acceptance (adaptive speculation)")
    p.add_argument("--depth", type=int, default=None, help="eagle_tree: tree depth")
    p.add_argument("--tree-top-k", type=int, default=None, help="eagle_tree: top-k children per level")
    p.add_argument("--total-tokens", type=int, default=None, help="eagle_tree: draft nodes verified per step")
    p.add_argument("--score-temperature", type=float, default=None,
                   help="eagle_tree: draft temperature for ranking tree nodes of greedy rows (default 0.2)")
    p.add_argument("--medusa-choices", default=None, help="medusa: JSON list of rank paths, e.g. '[[0],[1],[0,0]]'")
    p.add_argument("--tree-choices", default=None,
                   help="peagle_tree / dflash_tree: JSON list of rank paths over the draft positions (default: the "
                        "top-1 chain + runner-ups near the root)")
    p.add_argument("--max-ngram", type=int, default=None, help="prompt_lookup: longest n-gram matched")
    p.add_argument("--max-depth", type=int, default=None, help="suffix: suffix trie depth (longest match)")
    p.add_argument("--spec-factor", type=float, default=None, help="suffix: draft nodes per matched token")
    p.add_argument("--min-token-prob", type=float, default=None, help="suffix: least draft node probability")
    p.add_argument("--global-cache", type=int, default=None,
                   help="suffix: outputs kept in the model's global suffix store (later batches draft from them)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="compile the decode step's dense layer work with torch.compile (mode; default 'default'; "
                        "'reduce-overhead' = CUDA graphs on a GPU). Off by default: see the README's measurements")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (run under torchrun)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size of a MoE model (run under torchrun; "
                   "TP x EP must divide the world size)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-stream", action="store_true", help="print each completion only when it is finished")
    p.add_argument("--stats-json", default=None, help="write per-request stats to this JSON file")
    return p


def read_prompt_file(path: Any) -> List[str]:
    """Prompts of a --prompt-file: one per line (``\\n`` for a newline) or JSONL objects with a 'prompt' field."""
    path = Path(path)
    if not path.is_file():
        raise SamplingError(f"--prompt-file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SamplingError(f"--prompt-file {path} is not UTF-8 text ({e})") from e
    prompts = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
                prompts.append(str(obj["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SamplingError(f"{path}:{i + 1}: expected a JSON object with a 'prompt' field ({e!r})") from e
        else:
            prompts.append(line.replace("\\n", "\n"))
    return prompts


def read_prompts(args: argparse.Namespace, stdin: TextIO) -> List[str]:
    """Prompts from positional arguments, --prompt-file, or stdin."""
    prompts = [a for a in args.prompts if a != "-"]
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file)
    if not prompts or "-" in args.prompts:
        prompts += [line.replace("\\n", "\n") for line in stdin.read().splitlines() if line.strip()]
    if not prompts:
        raise SamplingError("no prompts given (arguments, --prompt-file or stdin)")
    return prompts


def _start_ids(tokenizer: Any) -> List[int]:
    """The ids an empty prompt starts from: the tokenizer's BOS (else its EOS, as many GPT-2-style tokenizers use)."""
    for t in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if t is not None:
            return [int(t)]
    raise SamplingError("empty prompt and the tokenizer has no BOS or EOS token to start from")


def options_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """Method options dict for :func:`nemo_spec.inference.generate`."""
    opts: Dict[str, Any] = {}
    for key, val in [("num_draft_tokens", args.num_draft_tokens), ("depth", args.depth), ("top_k", args.tree_top_k),
                     ("total_tokens", args.total_tokens), ("score_temperature", args.score_temperature),
                     ("max_ngram", args.max_ngram), ("max_depth", args.max_depth), ("spec_factor", args.spec_factor),
                     ("min_token_prob", args.min_token_prob), ("global_cache", args.global_cache),
                     ("compile", args.compile)]:
        if val is not None:
            opts[key] = val
    if getattr(args, "adaptive", False):
        opts["adaptive"] = True
    for key in ("medusa_choices", "tree_choices"):
        val = getattr(args, key)
        if val:
            try:
                opts[key] = [tuple(c) for c in json.loads(val)]
            except (json.JSONDecodeError, TypeError) as e:
                flag = "--" + key.replace("_", "-")
                raise SamplingError(f"{flag} must be a JSON list of lists, got {val!r}") from e
    if args.ignore_eos:
        opts["ignore_eos"] = True
    return opts


class TextStreamer:
    """Prints newly accepted text of one row as it arrives (decodes the whole row, prints the new suffix).
    ``prefix`` (the prompt) is printed with the first tokens, so nothing is printed for a request that fails
    before it generates; :meth:`finish` prints it if no token came."""

    def __init__(self, tokenizer: Any, out: TextIO, prefix: str = "", prompt: Sequence[int] = ()) -> None:
        self.tok, self.out = tokenizer, out
        self.prompt = list(prompt)  # decoded ahead of the row's tokens: the text continues the prompt
        self.ids: List[int] = []
        self.printed = ""
        self.prefix: Optional[str] = prefix

    def finish(self) -> None:
        if self.prefix is not None:
            self.out.write(self.prefix)
            self.prefix = None

    def __call__(self, row: int, ids: List[int]) -> None:
        self.finish()
        self.ids.extend(ids)
        text = continuation_text(self.tok, self.prompt, self.ids)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more tokens
            return None
        self.out.write(text[len(self.printed):] if text.startswith(self.printed) else "\n" + text)
        self.out.flush()
        self.printed = text
        return None


def main(argv: Optional[Sequence[str]] = None, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
         stderr: TextIO = sys.stderr) -> int:
    """Run the generate CLI; returns the process exit code."""
    import torch

    from nemo_spec import parallel
    from nemo_spec.checkpoint import detect_format, find_tokenizer_dir, load_model
    from nemo_spec.data.chat import load_tokenizer
    from nemo_spec.inference.generate import end_of_sequence_ids, generate, get_engine
    from nemo_spec.inference.proposers import make_proposer

    args = build_parser().parse_args(_bare_compile(sys.argv[1:] if argv is None else argv))
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop), seed=args.seed)
    if args.batch_size < 1:
        raise SamplingError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.method == "draft_model" and not args.draft_model:
        raise SamplingError("--method draft_model needs --draft-model PATH")
    options = options_from_args(args)
    prompts = read_prompts(args, stdin)
    if not os.path.exists(args.model):
        raise SamplingError(f"--model {args.model}: no such checkpoint directory")
    detect_format(args.model)  # a directory that is not a model is named as such before the tokenizer is looked for
    tok_path = args.tokenizer or find_tokenizer_dir(args.model)
    if tok_path is None:
        raise SamplingError(f"no tokenizer found with checkpoint {args.model}; pass --tokenizer")
    tokenizer = load_tokenizer(tok_path)
    parallel.initialize(tensor_parallel_size=args.tp or 1, expert_parallel_size=args.ep or 1)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype=dtype)
    draft = load_model(args.draft_model, dtype=dtype) if args.draft_model else None
    rank0 = parallel.is_rank_zero()
    if not args.ignore_eos:  # the tokenizer's end of sequence stops too, as in the server
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids,
                                                             *end_of_sequence_ids(model, tokenizer)))
    # text to continue: no special tokens (as benchmark.py); an empty prompt starts from BOS (was the pad id 0,
    # which DFlash drafts use as their mask token)
    all_ids = [tokenizer.encode(p, add_special_tokens=False) or _start_ids(tokenizer) for p in prompts]
    # every prompt checked (context, token ids, the method's own limits) before the first one generates
    engine = get_engine(model)
    proposer = make_proposer(args.method, model, engine, draft, options)
    for i, ids in enumerate(all_ids):
        engine.check_row(i, ids, params, proposer.lookahead, None, None, tokenizer)
        try:
            proposer.check_row(ids, params)
        except SamplingError as err:
            raise SamplingError(f"prompt {i}: {err}") from None
    records = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start: start + args.batch_size]
        ids = all_ids[start: start + args.batch_size]
        stream = rank0 and not args.no_stream and len(chunk) == 1
        streamer = TextStreamer(tokenizer, stdout, prefix=chunk[0], prompt=ids[0]) if stream else None
        results = generate(model, ids, params, method=args.method, draft_model=draft, options=options,
                           tokenizer=tokenizer, on_tokens=streamer)
        for i, (prompt, res) in enumerate(zip(chunk, results)):
            if rank0:
                if streamer is not None:
                    streamer.finish()
                    stdout.write("\n")
                else:
                    stdout.write(f"=== [{start + i}] ===\n{prompt}{res.text}\n")
                s = res.stats
                stderr.write(f"[{start + i}] {args.method}: {s['new_tokens']} tokens, finish={res.finish_reason}, "
                             f"tau={s['tau']:.2f}, target_forwards={s['target_forwards']}, "
                             f"draft_forwards={s['draft_forwards']}, {s['tokens_per_s']:.1f} tok/s, "
                             f"accept_hist={s['accept_hist']}, peak_mem={s['peak_memory_bytes'] / 2**20:.0f} MiB\n")
            records.append({"prompt": prompt, "text": res.text, "tokens": res.tokens,
                            "finish_reason": res.finish_reason, "stats": res.stats})
    if args.stats_json and rank0:
        write_text_atomic(args.stats_json, json.dumps(records, indent=2))
    return 0
