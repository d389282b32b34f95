"""Test helpers: tiny model configs and a torchrun launcher for multi-process (gloo) tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

from nemo_spec.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def same_across_ranks(group, t) -> bool:
    """Under torch.distributed: whether ``t`` is bit-identical on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def tiny_llama(**kw) -> ModelConfig:
    """A tiny Llama-style config with GQA (4 heads, 2 groups) that TP=2 can shard."""
    base = dict(vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, max_position_embeddings=256, rope_theta=10000.0)
    base.update(kw)
    return ModelConfig(**base)


def tiny_gpt2(**kw) -> ModelConfig:
    """A tiny GPT-2-style config (learned positions, LayerNorm, GELU, biases, tied embeddings)."""
    base = dict(vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                max_position_embeddings=256, family="gpt2", normalization="LayerNorm", activation="gelu",
                position_embedding="learned", add_bias_linear=True, tie_word_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path | str, args: Sequence[str] = (), nproc: int = 2, timeout: int = 180) -> str:
    """Run ``script`` under ``torchrun --nproc_per_node nproc`` (gloo, CPU); return stdout, raise on failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd: List[str] = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                      "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({p.returncode}):\nSTDOUT:\n{p.stdout[-4000:]}\nSTDERR:\n{p.stderr[-8000:]}")
    return p.stdout


def readme_smoke_commands() -> List[str]:
    """The README's smoke-run commands, exactly as written (lines of its bash blocks marked '# smoke run')."""
    import re

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.rstrip().endswith("# smoke run")]


def run_readme_command(cmd: str, timeout: int = 1200) -> "subprocess.CompletedProcess[str]":
    """Run a README command line literally (shell, repository root, ``python`` = this venv) from nothing: a
    ``--cache_dir`` it names is removed first, as for a new user. Asserts exit 0; returns the finished process."""
    import shlex
    import shutil

    argv = shlex.split(cmd)
    if "--cache_dir" in argv:
        shutil.rmtree(argv[argv.index("--cache_dir") + 1], ignore_errors=True)
    env = script_env()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def script_env() -> dict:
    """Environment for running a script as a user would: one thread, this checkout importable, no torchrun or
    debugging variables inherited from the test process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HYDRA_FULL_ERROR",
              "NEMO_SPEC_DEBUG", "PYTHONWARNINGS"):
        env.pop(k, None)
    return env


def timed_rows(module):
    """Row counts for which the few-row CPU kernels of ``module``'s weights have been timed (fastpath groups)."""
    from nemo_spec.models import fastpath

    groups = {id(g): g for g in (fastpath._GROUP_OF.get(id(p)) for p in module.parameters()) if g is not None}
    return {k[2] for g in groups.values() for k in g.choice}
