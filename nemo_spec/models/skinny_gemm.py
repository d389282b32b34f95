"""A compiled CPU kernel for products of few rows, ``x @ W^T`` with x of 1-32 rows (see ``skinny_gemm.cpp``).

CPU GEMM libraries leave most of the memory bandwidth unused for such skinny products: on the project's 2-core
host SmolLM2-135M's 30 layers of weights (0.42 GB fp32) stream through ``F.linear`` at ~12 GB/s for one row and
~6 GB/s for 2-16 rows, while the host reads ~30 GB/s. The kernel splits the output columns over torch's own OpenMP
thread team and multiplies each block of weight rows into the rows of x in groups of up to 6, the block read from
memory once (see the source's header).

It is built on first use with the system C++ compiler (``$CXX``, default ``g++``; ``-O3 -march=native``) into
``$NEMO_SPEC_KERNEL_DIR`` (default ``~/.cache/nemo_spec/kernels``), keyed by the source, the compiler, the CPU's
feature flags and torch's version, written to a temporary name and renamed (concurrent builders never see half a
library). It is loaded with ctypes and used only if it joins the OpenMP runtime torch already loaded (a second
runtime would start a second thread team, which throttles both, see ``nemo_spec/_threads.py``). Without a compiler,
on another OpenMP runtime, or with ``NEMO_SPEC_SKINNY_GEMM=0`` it is simply unavailable: :mod:`fastpath` then
chooses among torch's kernels as before. :func:`unavailable_reason` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("skinny_gemm.cpp")
#: ``0`` turns the kernel off (fastpath then uses torch's kernels only)
ENV_SWITCH = "NEMO_SPEC_SKINNY_GEMM"
ENV_DIR = "NEMO_SPEC_KERNEL_DIR"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_LOCK = threading.Lock()
_fn: Any = None  # the ctypes product function once loaded
_norm: Any = None  # the ctypes RMSNorm function
_tried = False
_reason = "not tried yet"


def cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nemo_spec" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.machine() + platform.processor()


def _openmp_runtimes() -> set:
    """Paths of the OpenMP runtimes mapped into this process (libgomp, libiomp, libomp)."""
    names = ("libgomp", "libiomp", "libomp")
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if any(n in line.rsplit("/", 1)[-1] for n in names)}


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode(),
                 torch.__version__.encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"skinny_gemm-{h.hexdigest()[:16]}.so"


def _build(cxx: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cxx, *FLAGS, str(SOURCE), "-o", str(tmp)]
    log.info("building the skinny-GEMM CPU kernel: %s", " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load() -> Any:
    """The kernel function, building the library if needed; raises RuntimeError saying why it cannot be used."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise RuntimeError(f"turned off ({ENV_SWITCH}=0)")
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"only built on Linux (this is {sys.platform})")
    if "OpenMP" not in torch.__config__.parallel_info():
        raise RuntimeError("torch's parallel backend is not OpenMP")
    before = _openmp_runtimes()
    if len(before) != 1 or "libgomp" not in next(iter(before)):
        raise RuntimeError(f"torch's OpenMP runtime is not one libgomp (mapped: {sorted(before) or 'none'})")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set CXX)")
    path = _library_path(cxx)
    if not path.exists():
        _build(cxx, path)
    lib = ctypes.CDLL(str(path))
    after = _openmp_runtimes()
    if after != before:  # the library brought its own runtime: using it would start a second thread team
        raise RuntimeError(f"the built library maps a second OpenMP runtime ({sorted(after - before)})")
    fn = lib.nemo_spec_skinny_linear
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    norm = lib.nemo_spec_rms_norm
    norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float]
    norm.restype = None
    return fn, norm


def available() -> bool:
    """Whether the kernel can be used in this process (builds / loads it on the first call)."""
    global _fn, _norm, _tried, _reason
    if _tried:
        return _fn is not None
    with _LOCK:
        if not _tried:
            try:
                _fn, _norm = _load()
                _reason = ""
            except Exception as e:  # noqa: BLE001 — any failure just means torch's kernels are used
                _reason = str(e) or type(e).__name__
                log.warning("skinny-GEMM CPU kernel unavailable, using torch's kernels only: %s", _reason)
            _tried = True
    return _fn is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is available)."""
    available()
    return _reason


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (an [out, in] matrix) can go through the kernel: a contiguous fp32 CPU matrix."""
    return (weight.dtype == torch.float32 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.is_contiguous() and available())


def linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x2, weight)`` for x2 [rows, in] (fp32, CPU) and a weight :func:`supports` accepts: [rows, out]."""
    if not available():
        raise RuntimeError(f"the skinny-GEMM CPU kernel is unavailable: {_reason}")
    if not supports(weight):
        raise ValueError(f"skinny_gemm.linear needs a contiguous fp32 CPU weight matrix, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}{'' if weight.is_contiguous() else ' (not contiguous)'}")
    rows, k = x2.shape
    if x2.dtype != torch.float32 or x2.device.type != "cpu" or k != weight.shape[1]:
        raise ValueError(f"x must be fp32 CPU [rows, {weight.shape[1]}], got {tuple(x2.shape)} {x2.dtype} on "
                         f"{x2.device}")
    x2 = x2.contiguous()
    y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    _fn(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, k, weight.shape[0], torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (D,), weight, eps)`` for fp32 CPU x [..., D] of few rows (same shape out): the library's
    row-by-row RMSNorm, without torch's per-op dispatch. Needs :func:`supports_norm`."""
    if not supports_norm(x, weight):
        raise ValueError(f"skinny_gemm.rms_norm needs fp32 CPU x [..., D] and a contiguous fp32 weight [D], got "
                         f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    d = x.shape[-1]
    _norm(xc.data_ptr(), weight.data_ptr(), y.data_ptr(), xc.numel() // d, d, float(eps))
    return y


def supports_norm(x: torch.Tensor, weight: Optional[torch.Tensor]) -> bool:
    """Whether :func:`rms_norm` applies: fp32 CPU x and a contiguous fp32 weight over its last dim, kernel built."""
    return (weight is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.is_contiguous() and available())


def reset() -> None:
    """Forget the load attempt (tests: the next :func:`available` builds / loads again)."""
    global _fn, _norm, _tried, _reason
    with _LOCK:
        _fn, _norm, _tried, _reason = None, None, False, "not tried yet"
