"""The built-in corpus: the running interpreter's standard-library Python source (tests excluded).

Files are listed in a deterministic order (sorted relative POSIX paths) and split into a training
part and a held-out part by a hash of each file's relative path, so the split does not depend on
the order of the listing and stays put when an unrelated file changes. The held-out part is used
for the base model's evaluation loss and for benchmark prompts (:func:`heldout_prompts`).
"""
from __future__ import annotations

import ast
import hashlib
import logging
import os
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

#: directory names never entered (tests, third-party packages, caches, generated docs)
DEFAULT_EXCLUDE_DIRS: Tuple[str, ...] = ("test", "tests", "idle_test", "site-packages", "dist-packages",
                                         "__pycache__", "pydoc_data")


class CorpusError(RuntimeError):
    """The corpus cannot be built (missing directory, empty selection, bad split)."""


def stdlib_dir() -> Path:
    """The running interpreter's standard-library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith("_test.py")


def list_source_files(root: Optional[Path] = None,
                      exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS) -> List[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root`` (default: stdlib), sorted, tests excluded."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise CorpusError(f"corpus root {root} is not a directory")
    excluded = set(exclude_dirs)
    out: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # prune excluded dirs instead of walking them
        dirnames[:] = [d for d in dirnames if d not in excluded and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.endswith(".py") or _is_test_file(name) or path.is_symlink() or not path.is_file():
                continue
            out.append(path.relative_to(root).as_posix())
    out.sort()
    if not out:
        raise CorpusError(f"no *.py files under {root} after excluding {sorted(excluded)}")
    return out


def is_heldout(relpath: str, fraction: float) -> bool:
    """Whether ``relpath`` belongs to the held-out slice (stable hash of the path, ``fraction`` of files)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def read_source(path: Path) -> str:
    """A source file's text (UTF-8; undecodable bytes replaced, never an error)."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """A split of source files: ``train`` and ``heldout`` relative paths under ``root``, plus a fingerprint."""

    root: Path
    train: List[str]
    heldout: List[str]
    fingerprint: str
    exclude_dirs: Tuple[str, ...] = field(default=DEFAULT_EXCLUDE_DIRS)

    def texts(self, split: str) -> Iterator[str]:
        """Texts of the files of ``split`` ("train" or "heldout"), in order."""
        if split not in ("train", "heldout"):
            raise CorpusError(f"unknown corpus split {split!r}; use 'train' or 'heldout'")
        for rel in getattr(self, split):
            yield read_source(self.root / rel)

    def num_bytes(self, split: str) -> int:
        """Total size in bytes of ``split``."""
        return sum((self.root / rel).stat().st_size for rel in getattr(self, split))

    def write_split(self, split: str, out_dir: Path) -> Path:
        """Copy ``split``'s files as UTF-8 text under ``out_dir`` (same relative paths); returns ``out_dir``."""
        out_dir = Path(out_dir)
        for rel, text in zip(getattr(self, split), self.texts(split)):
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(dst)
        return out_dir


def load_corpus(root: Optional[Path] = None, heldout_fraction: float = 0.05, max_bytes: Optional[int] = None,
                exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS) -> Corpus:
    """List, split and fingerprint the corpus; ``max_bytes`` caps each split's size (first files in order)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise CorpusError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if max_bytes is not None and max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive or None, got {max_bytes!r}")
    root = Path(root) if root is not None else stdlib_dir()
    files = list_source_files(root, exclude_dirs)
    train: List[str] = []
    heldout: List[str] = []
    sizes = {"train": 0, "heldout": 0}
    for rel in files:
        split = "heldout" if is_heldout(rel, heldout_fraction) else "train"
        cap = None if max_bytes is None else (max_bytes if split == "train" else max(1, int(max_bytes * heldout_fraction)))
        size = (root / rel).stat().st_size
        if cap is not None and sizes[split] >= cap:
            continue
        sizes[split] += size
        (heldout if split == "heldout" else train).append(rel)
    if not train or not heldout:
        raise CorpusError(f"corpus split under {root} is empty (train={len(train)}, heldout={len(heldout)} files; "
                          f"heldout_fraction={heldout_fraction})")
    h = hashlib.sha256()
    h.update(f"python {sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for split, rels in (("train", train), ("heldout", heldout)):
        for rel in rels:
            h.update(f"{split}:{rel}:".encode())
            h.update(hashlib.sha256((root / rel).read_bytes()).digest())
    corpus = Corpus(root=root, train=train, heldout=heldout, fingerprint=h.hexdigest()[:16],
                    exclude_dirs=tuple(exclude_dirs))
    log.info("corpus %s: %d train files (%.1f MB), %d held-out files (%.1f MB), fingerprint %s", root,
             len(train), sizes["train"] / 1e6, len(heldout), sizes["heldout"] / 1e6, corpus.fingerprint)
    return corpus


@dataclass
class CodePrompt:
    """A held-out code-completion prompt: the file text up to a function body, and the true continuation."""

    path: str
    prompt: str
    reference: str


def heldout_samples(corpus: Corpus, n: int = 32, max_prompt_chars: int = 1200, reference_chars: int = 600,
                    min_prompt_chars: int = 200, seed: int = 0) -> List[CodePrompt]:
    """Up to ``n`` deterministic code-completion samples cut from held-out files at function definitions.

    Each prompt is the (tail of the) file text ending right after a ``def`` line, so the model is asked
    to write the function body; ``reference`` is the file's actual continuation.
    """
    if n <= 0:
        raise CorpusError(f"n must be positive, got {n}")
    candidates: List[CodePrompt] = []
    for rel, text in zip(corpus.heldout, corpus.texts("heldout")):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            body_line = node.body[0].lineno - 1  # 0-based first body line
            if body_line <= node.lineno - 1 or body_line >= len(lines):
                continue  # one-line def
            cut = offsets[body_line]
            if cut < min_prompt_chars:
                continue
            start = max(0, cut - max_prompt_chars)
            if start > 0:  # start on a line boundary
                nl = text.find("\n", start, cut)
                start = nl + 1 if nl != -1 else start
            prompt = text[start:cut]
            reference = text[cut:cut + reference_chars]
            if len(prompt) >= min_prompt_chars and reference.strip():
                candidates.append(CodePrompt(path=rel, prompt=prompt, reference=reference))
    if not candidates:
        raise CorpusError(f"no function definitions found in {len(corpus.heldout)} held-out files")
    candidates.sort(key=lambda c: (c.path, len(c.prompt), c.prompt[-80:]))
    rng = random.Random(seed)
    rng.shuffle(candidates)
    # prefer variety: at most one prompt per file in the first pass
    picked: List[CodePrompt] = []
    seen: set = set()
    for c in candidates:
        if c.path not in seen:
            picked.append(c)
            seen.add(c.path)
        if len(picked) == n:
            return picked
    for c in candidates:
        if len(picked) == n:
            break
        if c not in picked:
            picked.append(c)
    return picked


def heldout_prompts(corpus: Optional[Corpus] = None, n: int = 32, max_prompt_chars: int = 1200,
                    seed: int = 0) -> List[str]:
    """Held-out code prompts (strings) for benchmarks; loads the default stdlib corpus when none is given."""
    corpus = corpus if corpus is not None else load_corpus()
    return [s.prompt for s in heldout_samples(corpus, n=n, max_prompt_chars=max_prompt_chars, seed=seed)]
