"""Tokenised datasets, a data-parallel deterministic batch sampler (resumable), and the Lightning DataModule."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nemo_spec.config import ConfigError
from nemo_spec.data.chat import (ChatTemplateError, Encoded, apply_chat_template, encode_chat, encode_text,
                                 record_messages)
from nemo_spec.data.formats import EmptyDatasetError, ReadStats, read_conversations

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    """Where the training data is and how to turn it into token batches."""

    path: Union[str, List[str], None] = None
    format: str = "daring_anteater"  # daring_anteater | sharegpt | messages | text | auto
    max_seq_len: int = 512
    loss_on: str = "assistant"  # assistant | all
    system_prompt: Optional[str] = None
    val_fraction: float = 0.05
    val_max_samples: int = 64
    seed: int = 1234
    strict: bool = False
    max_samples: Optional[int] = None
    num_workers: int = 0
    offline_dir: Optional[str] = None  # precomputed base outputs (offline mode)

    def validate(self) -> "DataConfig":
        """Raise ConfigError (a ValueError) naming the first invalid field; returns self."""
        if not self.path and not self.offline_dir:
            raise ConfigError("data.path is required (a file or directory of training data)")
        if self.max_seq_len < 4:
            raise ConfigError(f"data.max_seq_len must be >= 4, got {self.max_seq_len}")
        if self.loss_on not in ("assistant", "all"):
            raise ConfigError(f"data.loss_on must be 'assistant' or 'all', got {self.loss_on!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"data.max_samples must be >= 1 or null (all records), got {self.max_samples}")
        for name in ("val_max_samples", "num_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        return self


@dataclass
class DataStats:
    """What happened while building the dataset."""

    read: ReadStats = field(default_factory=ReadStats)
    samples: int = 0
    truncated: int = 0
    no_target: int = 0
    short_text: int = 0  # text documents under encode_text's minimum length
    template_errors: int = 0  # conversations the chat template renders in a way no assistant span can be found in
    first_template_error: str = ""


class TokenDataset(Dataset):
    """A list of (input_ids, loss_mask) samples."""

    def __init__(self, samples: Sequence[Encoded]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.samples[i]
        return {"input_ids": s.input_ids, "loss_mask": s.loss_mask}


def encode_records(records: Sequence[Dict[str, Any]], tokenizer: Any, cfg: DataConfig,
                   stats: Optional[DataStats] = None) -> List[Encoded]:
    """Tokenise records (chat or text) into samples, counting truncated ones and ones without targets."""
    stats = stats if stats is not None else DataStats()
    out: List[Encoded] = []
    for r in records:
        if not r["turns"]:
            chunks = encode_text(tokenizer, r["text"], cfg.max_seq_len)
            stats.short_text += not chunks
            out.extend(chunks)
            continue
        try:
            e = encode_chat(tokenizer, r, cfg.max_seq_len, cfg.loss_on, cfg.system_prompt)
        except ChatTemplateError as err:  # one such conversation used to end the whole run, unnamed
            where = r.get("_where") or r.get("id") or "a record"
            if cfg.strict:
                raise ChatTemplateError(f"{where}: {err}") from err
            stats.template_errors += 1
            stats.first_template_error = stats.first_template_error or f"{where}: {err}"
            continue
        stats.truncated += int(e.truncated)
        if int(e.loss_mask[1:].sum()) == 0:
            stats.no_target += 1
            continue
        out.append(e)
    stats.samples = len(out)
    if stats.truncated:
        log.warning("%d sample(s) longer than max_seq_len=%d were truncated", stats.truncated, cfg.max_seq_len)
    if stats.no_target:
        log.warning("%d sample(s) had no assistant token to train on (after truncation) and were dropped",
                    stats.no_target)
    if stats.short_text:
        log.warning("%d text document(s) shorter than 8 tokens were dropped", stats.short_text)
    if stats.template_errors:
        log.warning("%d conversation(s) skipped: the chat template cannot mark their assistant tokens (strict=true "
                    "stops at the first; loss_on=all trains on them whole); first: %s", stats.template_errors,
                    stats.first_template_error)
    return out


def split_indices(n: int, val_fraction: float, val_max: int, seed: int) -> Tuple[List[int], List[int]]:
    """Seeded train/validation split of ``n`` items (at least one train item)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    n_val = min(val_max, int(round(n * val_fraction))) if val_fraction > 0 else 0
    n_val = min(n_val, n - 1)
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def collate(batch: Sequence[Dict[str, torch.Tensor]], pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """Right-pad a list of samples into [b, s] tensors (padding has loss_mask 0)."""
    s = max(x["input_ids"].numel() for x in batch)
    ids = torch.full((len(batch), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), s), dtype=torch.long)
    for i, x in enumerate(batch):
        n = x["input_ids"].numel()
        ids[i, :n] = x["input_ids"]
        mask[i, :n] = x["loss_mask"]
    out = {"input_ids": ids, "loss_mask": mask}
    for k in batch[0]:
        if k not in out:
            out[k] = torch.stack([x[k] for x in batch])
    return out


def data_parallel_rank_size() -> Tuple[int, int]:
    """(rank, size) of this process in megatron's data-parallel group ((0, 1) when not initialised)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return 0, 1


class DataParallelBatchSampler(Sampler[List[int]]):
    """Deterministic (seed, epoch) shuffle; each global batch of ``micro_bs * dp_size`` is split across DP ranks.

    All tensor-parallel ranks of one DP rank see identical batches. ``skip_samples(n)`` resumes mid-epoch after
    ``n`` globally consumed samples (works across a change of DP size). With ``accumulation`` (micro-batches per
    optimizer step) an epoch ends with the last whole optimizer step: a partial one would step on fewer samples
    while the loss is still divided by the full accumulation (lightning loops/optimization/automatic.py), i.e. a
    smaller, silently down-scaled gradient. The trainer must call ``set_epoch`` at each epoch's start (Lightning
    finds only a DataLoader's ``sampler`` or ``batch_sampler.sampler``; SpeculativeLightningModule does it).
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True, seed: int = 1234, drop_last: bool = True, accumulation: int = 1,
                 what: str = "the training data") -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        self.n, self.mbs, self.rank, self.size = num_samples, micro_batch_size, dp_rank, dp_size
        self.shuffle, self.seed, self.drop_last, self.accumulation = shuffle, seed, drop_last, accumulation
        self.epoch = 0
        self._skip = 0
        self.step = step = self.mbs * self.size * self.accumulation  # global samples per optimizer step
        if drop_last and self.n < step:
            parts = f"micro_batch_size={self.mbs} x data_parallel={self.size}"
            if accumulation > 1:
                parts += f" x accumulation={accumulation}"
            raise EmptyDatasetError(f"{what}: {self.n} sample(s) is fewer than one "
                                    f"{'optimizer step' if accumulation > 1 else 'global micro-batch'} "
                                    f"({parts} = {step})")

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch``."""
        self.epoch = epoch

    def skip_samples(self, consumed: int) -> None:
        """Skip the first ``consumed`` global samples of the next iteration (mid-epoch resume)."""
        self._skip = consumed

    def _order(self) -> List[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + 1000003 * self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def samples_per_epoch(self) -> int:
        """Global samples one epoch serves (whole optimizer steps with drop_last)."""
        return (self.n // self.step) * self.step if self.drop_last else self.n

    def __len__(self) -> int:
        gb = self.mbs * self.size
        return self.samples_per_epoch() // gb if self.drop_last else math.ceil(self.n / gb)

    def __iter__(self) -> Iterator[List[int]]:
        order = self._order()[:self.samples_per_epoch()]
        gb = self.mbs * self.size
        start = (self._skip // gb) * gb
        self._skip = 0
        for a in range(start, len(order), gb):
            g = order[a:a + gb]
            if len(g) < gb and self.drop_last:
                return
            mine = g[self.rank * self.mbs:(self.rank + 1) * self.mbs]
            if mine:
                yield mine


class SpecDataModule(pl.LightningDataModule):
    """Reads, tokenises and splits chat/text data; serves DP-sharded micro-batches and held-out prompts."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, micro_batch_size: int = 2,
                 records: Optional[List[Dict[str, Any]]] = None) -> None:
        super().__init__()
        self.cfg = cfg.validate() if records is None else cfg
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.accumulation = 1  # micro-batches per optimizer step (set by the runner): epochs end on whole steps
        self._records = records
        self.stats = DataStats()
        self.train_set: Optional[TokenDataset] = None
        self.val_set: Optional[TokenDataset] = None
        self.val_records: List[Dict[str, Any]] = []
        self.train_sampler: Optional[DataParallelBatchSampler] = None
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)

    def setup(self, stage: Optional[str] = None) -> None:
        """Read and tokenise once; split into train/validation."""
        if self.train_set is not None:
            return
        records = self._records
        if records is None:
            records = read_conversations(self.cfg.path, self.cfg.format, strict=self.cfg.strict, stats=self.stats.read)
        if self.cfg.max_samples is not None:
            records = records[: self.cfg.max_samples]
        tr_idx, va_idx = split_indices(len(records), self.cfg.val_fraction, self.cfg.val_max_samples, self.cfg.seed)
        if len(records) == 1 and records[0]["turns"] == [] and self.cfg.val_fraction > 0:
            tr_idx, va_idx = [0], []  # one text document: split its chunks instead
        train = encode_records([records[i] for i in tr_idx], self.tokenizer, self.cfg, self.stats)
        val_stats = DataStats()
        val = encode_records([records[i] for i in va_idx], self.tokenizer, self.cfg, val_stats)
        if not va_idx and self.cfg.val_fraction > 0 and len(train) > 1:
            n_val = max(1, min(self.cfg.val_max_samples, int(round(len(train) * self.cfg.val_fraction))))
            tr, va = split_indices(len(train), n_val / len(train), n_val, self.cfg.seed)
            train, val = [train[i] for i in tr], [train[i] for i in va]
        if not train:
            why = [f"{self.stats.no_target} without assistant tokens after truncation"]
            if self.stats.short_text:
                why.append(f"{self.stats.short_text} text document(s) shorter than 8 tokens")
            if self.stats.template_errors:
                why.append(f"{self.stats.template_errors} the chat template cannot mark "
                           f"({self.stats.first_template_error})")
            raise EmptyDatasetError(f"no trainable samples in {self.cfg.path} (read {len(records)} record(s); "
                                    f"{'; '.join(why)})")
        self.val_records = [records[i] for i in va_idx]
        self.train_set, self.val_set = TokenDataset(train), TokenDataset(val)
        log.info("dataset: %d train / %d validation samples (truncated %d, skipped %d malformed)",
                 len(train), len(val), self.stats.truncated, self.stats.read.skipped)

    def _collate(self, batch: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return collate(batch, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        """DP-sharded, deterministic, resumable training loader."""
        self.setup()
        rank, size = data_parallel_rank_size()
        self.train_sampler = DataParallelBatchSampler(len(self.train_set), self.micro_batch_size, rank, size,
                                                      shuffle=True, seed=self.cfg.seed, accumulation=self.accumulation,
                                                      what="the training split")
        return DataLoader(self.train_set, batch_sampler=self.train_sampler, collate_fn=self._collate,
                          num_workers=self.cfg.num_workers)

    def val_dataloader(self) -> List[DataLoader] | DataLoader:
        """Validation loader (each DP rank takes its share; empty list when there is no validation data)."""
        self.setup()
        if not len(self.val_set):
            return []
        rank, size = data_parallel_rank_size()
        if len(self.val_set) < size:
            # a rank without a validation batch would leave the others waiting in the metrics' average over the
            # data-parallel ranks (and in the MoE dispatcher's collectives under expert parallelism)
            from nemo_spec.config import ConfigError

            raise ConfigError(f"the validation split has {len(self.val_set)} samples, fewer than the {size} data-"
                              "parallel ranks; every rank must run each validation step: raise data.val_fraction / "
                              "data.val_max_samples, or set data.val_fraction=0")
        # a micro-batch every rank can fill (3 validation samples at micro-batch 2 over 2 ranks were refused as
        # "fewer than one global micro-batch", naming neither the split nor a fix)
        mbs = max(1, min(self.micro_batch_size, len(self.val_set) // size))
        sampler = DataParallelBatchSampler(len(self.val_set), mbs, rank, size, shuffle=False,
                                           what="the validation split")
        return DataLoader(self.val_set, batch_sampler=sampler, collate_fn=self._collate,
                          num_workers=self.cfg.num_workers)

    def val_prompts(self, n: int, max_prompt_len: int = 64) -> List[List[int]]:
        """Token ids of up to ``n`` held-out prompts (chat: up to the first assistant turn; text: a prefix)."""
        self.setup()
        out: List[List[int]] = []
        for r in self.val_records:
            if len(out) >= n:
                break
            if r["turns"]:
                msgs = record_messages(r, self.cfg.system_prompt)
                first_asst = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
                ids = apply_chat_template(self.tokenizer, msgs[:first_asst], add_generation_prompt=True)
                out.append(ids[-max_prompt_len:])
        if not out:  # plain text (or no held-out chats): prefixes of held-out samples
            for s in self.val_set.samples[:n]:
                ids = s.input_ids.tolist()
                out.append(ids[: max(4, min(max_prompt_len, len(ids) // 2))])
        return out

