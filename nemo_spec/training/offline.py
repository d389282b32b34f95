"""Offline mode: run the frozen base once over the data, store its hidden states in safetensors shards, and train
the draft from them without running the base decoder again.

Stored per sample: ``input_ids`` [s], ``loss_mask`` [s], ``hidden`` [s, h] (final-normed base hidden state) and, for
EAGLE-3, ``aux`` [s, n, h] (the auxiliary layer outputs). The base's next-token distribution (the draft's target) is
recomputed from ``hidden`` by the frozen output layer — the same operation the base does, at a small fraction of a
base forward — so nothing of size [s, vocab] is written. Layout of ``offline_dir``::

    index.json                      {"format", "num_samples", "shards": [{"file", "count"}], "aux_layers", ...}
    shard_r{dp}_{k:05d}.safetensors keys "<i>.input_ids", "<i>.loss_mask", "<i>.hidden", "<i>.aux"
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_spec.data.datamodule import DataParallelBatchSampler, EmptyDatasetError, split_indices
from nemo_spec.fsutil import default_modes
from nemo_spec.config import setting_differences
from nemo_spec.models.gpt import GPTOutput, gather_vocab, output_logits

log = logging.getLogger(__name__)

OFFLINE_FORMAT = "nemo_spec_offline_v1"


class OfflineDataError(RuntimeError):
    """The offline directory is missing, incomplete or does not match the model."""


def _save_shard(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    default_modes(tmp)  # safetensors writes 0o600
    os.replace(tmp, path)


@torch.no_grad()
def precompute(model: torch.nn.Module, samples: Sequence[Any], out_dir: str | os.PathLike, shard_size: int = 256,
               dtype: torch.dtype = torch.float32, batch_size: int = 8, source: Optional[Dict[str, Any]] = None) -> Path:
    """Run the frozen base of ``model`` (a SpeculativeGPT) over tokenised ``samples``; write shards + index.json.
    ``source`` (JSON): what the states were made from (base, data settings), checked by :func:`check_source`.

    Under torchrun every rank must call it (TP ranks compute together); DP ranks split the samples and the
    TP-rank-0 process of each DP rank writes its own shards; global rank 0 writes the index after a barrier.
    """
    from megatron.core import parallel_state as ps

    from nemo_spec import parallel

    if not hasattr(model, "base_forward"):
        raise TypeError(f"precompute needs a SpeculativeGPT (has base_forward), got {type(model).__name__}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dp_rank, dp = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()) \
        if ps.model_parallel_is_initialized() else (0, 1)
    writer = parallel.tp_rank() == 0
    mine = list(range(dp_rank, len(samples), dp))
    device = next(model.parameters()).device
    model.eval()
    shards: List[Dict[str, Any]] = []
    buf: Dict[str, torch.Tensor] = {}
    count = 0

    def flush() -> None:
        nonlocal buf, count
        if count and writer:
            name = f"shard_r{dp_rank}_{len(shards):05d}.safetensors"
            _save_shard(buf, out / name)
            shards.append({"file": name, "count": count})
        buf, count = {}, 0

    for a in range(0, len(mine), batch_size):
        idx = mine[a:a + batch_size]
        for i in idx:  # per-sample forward: no padding effects on stored states
            s = samples[i]
            ids = s.input_ids.to(device)[None]
            res = model.base_forward(ids, compute_logits=False)
            key = str(count)
            buf[f"{key}.input_ids"] = s.input_ids.cpu()
            buf[f"{key}.loss_mask"] = s.loss_mask.cpu()
            buf[f"{key}.hidden"] = res.hidden[0].to(dtype).cpu()
            if res.aux_hidden:
                buf[f"{key}.aux"] = torch.stack([h[0] for h in res.aux_hidden], dim=-2).to(dtype).cpu()
            count += 1
            if count >= shard_size:
                flush()
    flush()
    all_shards = [shards]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        gathered: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, shards)
        all_shards = gathered
    if parallel.is_rank_zero():
        flat = [sh for lst in all_shards for sh in lst]
        index = {"format": OFFLINE_FORMAT, "num_samples": sum(sh["count"] for sh in flat), "shards": flat,
                 "algorithm": getattr(model, "algorithm", None), "aux_layers": list(getattr(model, "aux_layers", [])),
                 "hidden_size": int(model.model_config.hidden_size), "vocab_size": int(model.model_config.vocab_size),
                 "dtype": str(dtype).replace("torch.", ""), "source": source}
        tmp = out / ".index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out / "index.json")
        log.info("precomputed base states for %d samples into %s (%d shards)", index["num_samples"], out, len(flat))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def read_index(offline_dir: str | os.PathLike) -> Dict[str, Any]:
    """The index.json of an offline directory (validated)."""
    p = Path(offline_dir) / "index.json"
    if not p.exists():
        raise OfflineDataError(f"{p} not found: run nemo_spec.training.offline.precompute first")
    index = json.loads(p.read_text())
    if index.get("format") != OFFLINE_FORMAT:
        raise OfflineDataError(f"{p}: format {index.get('format')!r}, expected {OFFLINE_FORMAT!r}")
    if not index["num_samples"]:
        raise EmptyDatasetError(f"{p}: no samples")
    return index


def check_model(index: Dict[str, Any], model: torch.nn.Module, offline_dir: str | os.PathLike) -> None:
    """Refuse stored states that lack what ``model`` (a SpeculativeGPT) reads: another hidden size or vocabulary,
    or — for a draft that reads auxiliary layers — other layers' states (which it would train on silently). States
    of another algorithm serve a draft that needs only the final hidden state (EAGLE-1, Medusa)."""
    cfg = model.model_config
    need = list(getattr(model, "aux_layers", []))
    diff = [f"{k}={index.get(k)!r} there, {v!r} in this model" for k, v in
            (("hidden_size", int(cfg.hidden_size)), ("vocab_size", int(cfg.vocab_size))) if k in index and index[k] != v]
    if need and "aux_layers" in index and list(index["aux_layers"]) != need:
        diff.append(f"aux_layers={index['aux_layers']!r} there, {need!r} read by this {getattr(model, 'algorithm', '')} "
                    f"draft")
    if diff:
        raise OfflineDataError(f"{Path(offline_dir) / 'index.json'}: the stored base states were made for another "
                               f"model ({'; '.join(diff)}); precompute them again for this one (delete the directory "
                               f"or set data.offline_dir elsewhere)")


def check_source(index: Dict[str, Any], source: Dict[str, Any], offline_dir: str | os.PathLike) -> None:
    """Refuse stored states made from other data or another base than ``source`` says (an index from before
    sources were recorded passes)."""
    saved = index.get("source")
    if not isinstance(saved, dict):
        return
    now = source
    if now.get("data.path") is None:  # training from the stored states alone: only the base must match
        saved = {k: v for k, v in saved.items() if not k.startswith("data.")}
        now = {k: v for k, v in now.items() if not k.startswith("data.")}
    diff = setting_differences(saved, now, "there")
    if diff:
        raise OfflineDataError(f"{Path(offline_dir) / 'index.json'}: the stored base states were made from other "
                               f"data or another base ({'; '.join(diff[:4])}); delete the directory to precompute "
                               f"them again, or set data.offline_dir elsewhere")


class OfflineDataset(Dataset):
    """Samples of an offline directory (shards opened lazily, memory-mapped by safetensors)."""

    def __init__(self, offline_dir: str | os.PathLike) -> None:
        self.dir = Path(offline_dir)
        self.index = read_index(self.dir)
        self._where: List[tuple[str, str]] = []
        from safetensors import safe_open

        for sh in self.index["shards"]:
            path = self.dir / sh["file"]
            if not path.exists():
                raise OfflineDataError(f"{path} listed in index.json is missing")
            try:  # a truncated or foreign shard failed inside a DataLoader worker with safetensors' bare message
                with safe_open(str(path), framework="pt") as f:
                    keys = set(f.keys())
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
                raise OfflineDataError(f"{path} (listed in index.json) is not a readable safetensors file ({e}); "
                                       f"recompute the states: delete {self.dir / 'index.json'}") from e
            missing = [f"{i}.input_ids" for i in range(sh["count"]) if f"{i}.input_ids" not in keys]
            if missing:
                raise OfflineDataError(f"{path} lacks {len(missing)} of its {sh['count']} samples "
                                       f"(e.g. {missing[0]}); recompute the states: delete {self.dir / 'index.json'}")
            self._where += [(sh["file"], str(i)) for i in range(sh["count"])]
        self._open: Dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        from safetensors import safe_open

        file, key = self._where[i]
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = safe_open(str(self.dir / file), framework="pt")
        item = {"input_ids": f.get_tensor(f"{key}.input_ids"), "loss_mask": f.get_tensor(f"{key}.loss_mask"),
                "base_hidden": f.get_tensor(f"{key}.hidden")}
        if f"{key}.aux" in f.keys():
            item["base_aux"] = f.get_tensor(f"{key}.aux")
        return item


def offline_collate(batch: Sequence[Dict[str, torch.Tensor]], pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """Right-pad ids/masks and the stored states along the sequence dimension."""
    s = max(x["input_ids"].numel() for x in batch)
    out: Dict[str, torch.Tensor] = {}
    for k in batch[0]:
        first = batch[0][k]
        t = torch.full((len(batch), s, *first.shape[1:]), pad_id if k == "input_ids" else 0, dtype=first.dtype)
        for i, x in enumerate(batch):
            t[i, : x[k].shape[0]] = x[k]
        out[k] = t
    return out


def base_output_from_batch(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> GPTOutput:
    """Rebuild the base output (gathered logits, hidden, aux hiddens) from stored states via the frozen head;
    EAGLE-3 gets no logits (its losses compute them from the hidden states one row block at a time)."""
    from nemo_spec.speculative import losses

    gpt = model.gpt
    hidden = batch["base_hidden"]
    w = next(gpt.parameters())
    logits = None
    alg = getattr(model, "algorithm", None)
    if alg != "dflash" and (alg not in ("eagle3", "peagle") or losses.REFERENCE_FORMULATION):  # DFlash: no logits
        with torch.no_grad():
            logits = gather_vocab(output_logits(gpt, hidden.to(w.dtype).transpose(0, 1).contiguous())
                                  ).transpose(0, 1)
    aux = list(batch["base_aux"].unbind(2)) if "base_aux" in batch else []
    return GPTOutput(logits=logits, hidden=hidden.to(w.dtype), aux_hidden=[a.to(w.dtype) for a in aux])


class OfflineDataModule(pl.LightningDataModule):
    """Train/validation loaders over an offline directory (DP-sharded, resumable like SpecDataModule)."""

    def __init__(self, offline_dir: str, micro_batch_size: int = 2, seed: int = 1234, val_fraction: float = 0.05,
                 val_max_samples: int = 64, pad_id: int = 0) -> None:
        super().__init__()
        self.offline_dir, self.micro_batch_size, self.seed = offline_dir, micro_batch_size, seed
        self.val_fraction, self.val_max_samples, self.pad_id = val_fraction, val_max_samples, pad_id
        self.full: Optional[OfflineDataset] = None
        self.train_sampler: Optional[DataParallelBatchSampler] = None
        self.accumulation = 1  # micro-batches per optimizer step (set by the runner)

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the index and split train/validation (seeded)."""
        if self.full is not None:
            return
        self.full = OfflineDataset(self.offline_dir)
        self.train_idx, self.val_idx = split_indices(len(self.full), self.val_fraction, self.val_max_samples,
                                                     self.seed)
        self.train_set = torch.utils.data.Subset(self.full, self.train_idx)
        self.val_set = torch.utils.data.Subset(self.full, self.val_idx)

    def _collate(self, batch: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return offline_collate(batch, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        """DP-sharded, resumable training loader over stored states."""
        from nemo_spec.data.datamodule import data_parallel_rank_size

        self.setup()
        rank, size = data_parallel_rank_size()
        self.train_sampler = DataParallelBatchSampler(len(self.train_set), self.micro_batch_size, rank, size,
                                                      seed=self.seed, accumulation=self.accumulation,
                                                      what=f"the training split of {self.offline_dir}")
        return DataLoader(self.train_set, batch_sampler=self.train_sampler, collate_fn=self._collate)

    def val_dataloader(self) -> List[DataLoader] | DataLoader:
        """Validation loader over held-out stored states."""
        self.setup()
        if not len(self.val_set):
            return []
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, collate_fn=self._collate)

    def val_prompts(self, n: int, max_prompt_len: int = 64) -> List[List[int]]:
        """Prefixes of held-out samples as prompts for tau."""
        self.setup()
        out = []
        for i in range(min(n, len(self.val_set))):
            ids = self.val_set[i]["input_ids"].tolist()
            out.append(ids[: max(4, min(max_prompt_len, len(ids) // 2))])
        return out
