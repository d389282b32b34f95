"""The compiled few-row CPU kernel (nemo_spec/models/skinny_gemm.cpp): F.linear's product for any row count and
shape, each row bit for bit independent of how many rows are computed with it, one OpenMP thread team (torch's),
an atomic cached build, and a clear fallback (torch's kernels) when it cannot be built or is turned off."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nemo_spec.models import fastpath, skinny_gemm
from tests.helpers import ROOT, script_env

needs_kernel = pytest.mark.skipif(not skinny_gemm.available(),
                                  reason=f"kernel unavailable here: {skinny_gemm.unavailable_reason()}")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("k,n", [(576, 960), (19, 7), (8, 1), (64, 3), (1536, 576), (33, 130)])
def test_equals_f_linear_and_rows_are_independent(threads, k, n):
    """Every row count 1..33 (above the per-pass maximum the rows go in several passes), odd K (the tail after the
    vector lanes), fewer output columns than threads: F.linear's product; and row i of an m-row product is bitwise
    the 1-row product of row i — a verification block gives exactly a decode step's numbers."""
    torch.manual_seed(k * 1000 + n)
    w = torch.randn(n, k)
    x = torch.randn(33, k)
    for t in (1, 2):
        threads(t)
        one = torch.cat([skinny_gemm.linear(x[i:i + 1], w) for i in range(33)])
        torch.testing.assert_close(one, F.linear(x, w), atol=1e-4, rtol=1e-5)
        for m in range(1, 34):
            got = skinny_gemm.linear(x[:m], w)
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert torch.equal(got, one[:m]), (t, m)
    # a non-contiguous x is copied, not misread
    xt = torch.randn(k, 5).t()
    torch.testing.assert_close(skinny_gemm.linear(xt, w), F.linear(xt, w), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_bad_inputs_are_named():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="float64"):
        skinny_gemm.linear(torch.randn(2, 16), w.double())
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.linear(torch.randn(2, 8), w.t())
    with pytest.raises(ValueError, match=r"\[rows, 16\]"):
        skinny_gemm.linear(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="float64"):
        skinny_gemm.linear(torch.randn(2, 16, dtype=torch.float64), w)
    assert not skinny_gemm.supports(w.t()) and not skinny_gemm.supports(w.half()) and skinny_gemm.supports(w)


_SCRIPT = r"""
import json, os, sys
import torch
torch.set_num_threads(2)
(torch.randn(1 << 20) + 1).sum()  # torch's team exists from here on
before = set(os.listdir("/proc/self/task"))
from nemo_spec.models import fastpath, skinny_gemm
ok = skinny_gemm.available()
w, x = torch.randn(300, 64), torch.randn(3, 64)
y = skinny_gemm.linear(x, w) if ok else None
from nemo_spec.models.fastpath import linear
with fastpath.small_gemm_rule("skinny"):
    same = torch.allclose(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)
print(json.dumps({"ok": ok, "reason": skinny_gemm.unavailable_reason(), "same": same,
                  "new_threads": len(set(os.listdir("/proc/self/task")) - before),
                  "runtimes": sorted(skinny_gemm._openmp_runtimes()),
                  "kinds": sorted({k for k, _ in fastpath.candidates(3, w)})}))
"""


def _run(tmp_path, **env):
    e = dict(script_env(), NEMO_SPEC_KERNEL_DIR=str(tmp_path / "kernels"), **env)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@needs_kernel
def test_fresh_build_is_cached_atomic_and_joins_torchs_thread_team(tmp_path):
    """A fresh process builds the library into the kernel dir (only the final file is left there), uses torch's
    libgomp (one runtime mapped, no thread started beyond torch's team), and a second process reuses the file."""
    out, _ = _run(tmp_path)
    assert out["ok"] and out["same"] and "skinny" in out["kinds"], out
    assert len(out["runtimes"]) == 1 and out["new_threads"] == 0, out
    files = os.listdir(tmp_path / "kernels")
    assert len(files) == 1 and files[0].startswith("skinny_gemm-") and files[0].endswith(".so"), files
    lib = tmp_path / "kernels" / files[0]
    mtime = lib.stat().st_mtime_ns
    out2, _ = _run(tmp_path)
    assert out2["ok"] and lib.stat().st_mtime_ns == mtime and os.listdir(tmp_path / "kernels") == files


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """The next available() call loads afresh under the test's environment; the real state is restored after."""
    monkeypatch.setenv("NEMO_SPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    skinny_gemm.reset()
    yield tmp_path / "kernels"
    monkeypatch.undo()
    skinny_gemm.reset()


@pytest.mark.parametrize("env,reason", [({"NEMO_SPEC_SKINNY_GEMM": "0"}, "turned off"),
                                        ({"CXX": "no-such-compiler-x"}, "no C++ compiler 'no-such-compiler-x'"),
                                        ({"CXX": "false"}, "failed")])
def test_unavailable_falls_back_to_torch_kernels(fresh_load, monkeypatch, caplog, env, reason):
    """Turned off, no compiler, or a failing build: a warning naming why, no skinny candidate, the forced
    ``skinny`` rule computes with F.linear, and nothing half-built is left in the kernel dir."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    w, x = torch.randn(30, 16), torch.randn(3, 16)
    with caplog.at_level("WARNING", logger="nemo_spec.models.skinny_gemm"):
        assert not skinny_gemm.available()
    assert reason in skinny_gemm.unavailable_reason() and "skinny-GEMM CPU kernel unavailable" in caplog.text
    assert "skinny" not in {k for k, _ in fastpath.candidates(3, w)}
    with fastpath.small_gemm_rule("skinny"):
        assert fastpath.kernel(w, 3) == ("linear", 3)
        torch.testing.assert_close(fastpath.linear(x, w), F.linear(x, w))
    with pytest.raises(RuntimeError, match="kernel is unavailable: .*" + re.escape(reason)):
        skinny_gemm.linear(x, w)
    assert not fresh_load.exists() or os.listdir(fresh_load) == []


@needs_kernel
def test_rms_norm_equals_torch_and_rows_are_independent(monkeypatch):
    """The library's RMSNorm: F.rms_norm's values for odd and vector-multiple widths, any leading shape; each row
    bitwise the same whatever the row count; the fast path uses it for few fp32 rows under auto / skinny only."""
    torch.manual_seed(0)
    for d in (576, 19, 8):
        w = torch.randn(d)
        x = torch.randn(2, 7, d) * 3
        got = skinny_gemm.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(got, F.rms_norm(x, (d,), w, 1e-5), atol=1e-5, rtol=1e-5)
        for i in range(7):
            assert torch.equal(skinny_gemm.rms_norm(x[:, i:i + 1], w, 1e-5), got[:, i:i + 1])
    with pytest.raises(ValueError, match="float64"):
        skinny_gemm.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight \(7,\)"):
        skinny_gemm.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    norm = torch.nn.RMSNorm(16, eps=None)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    calls = []
    real = skinny_gemm.rms_norm
    monkeypatch.setattr(skinny_gemm, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    for mode in ("auto", "skinny", "linear"):
        for x in (torch.randn(3, 1, 16), torch.randn(40, 1, 16)):  # 40 rows: more than a few
            with fastpath.small_gemm_rule(mode), torch.no_grad():
                torch.testing.assert_close(fastpath.norm(norm, x), norm(x), atol=1e-6, rtol=1e-6)
    assert calls == [(3, 1, 16), (3, 1, 16)]  # few rows under auto and skinny only


def _cpu_flags() -> set:
    return set(skinny_gemm._cpu_flags().split())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not skinny_gemm.available(),
                    reason="x86-64 ISA levels; needs the kernel's build prerequisites")
@pytest.mark.parametrize("march,needs", [("x86-64-v3", {"avx2", "fma"}), ("x86-64", set())])
def test_other_isa_levels_give_the_same_guarantees(fresh_load, monkeypatch, threads, march, needs):
    """The library is built with -march=native, so CI hosts differ in which of its paths they run: AVX-512 (16
    lanes), AVX2 (8 lanes) or SSE2 (GCC lowers the 8-lane vector type to pairs of 4). Each path this host can
    execute is built here and must give F.linear's product with every row bitwise independent of the row count
    (across several row groups) and of the thread count."""
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    monkeypatch.setattr(skinny_gemm, "FLAGS", tuple(f"-march={march}" if f == "-march=native" else f
                                                    for f in skinny_gemm.FLAGS))
    assert skinny_gemm.available(), skinny_gemm.unavailable_reason()
    assert len(os.listdir(fresh_load)) == 1  # built afresh for this -march
    torch.manual_seed(7)
    for k, n in ((576, 130), (19, 7)):
        w, x = torch.randn(n, k), torch.randn(20, k)
        ref = None
        for t in (1, 2):
            threads(t)
            one = torch.cat([skinny_gemm.linear(x[i:i + 1], w) for i in range(20)])
            torch.testing.assert_close(one, F.linear(x, w), atol=1e-4, rtol=1e-5)
            assert ref is None or torch.equal(one, ref)
            ref = one
            for m in range(1, 21):
                assert torch.equal(skinny_gemm.linear(x[:m], w), one[:m]), (march, t, m)
