#!/usr/bin/env python
"""Train a speculative draft (EAGLE-1, EAGLE-3, Medusa) with Lightning + Hydra.

    python scripts/train_speculative.py model_path=ckpt/base spec=eagle3 data=daring_anteater data.path=train.jsonl
    torchrun --nproc_per_node 2 scripts/train_speculative.py ... trainer.tensor_parallel_size=2
    torchrun --nproc_per_node 2 scripts/train_speculative.py ... trainer.expert_parallel_size=2   # MoE base
"""
from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@entry.report_user_errors
def main(cfg: DictConfig) -> None:
    from nemo_spec.training.cli import run_from_hydra, typed_config

    _, text = typed_config(cfg)
    print(text, flush=True)  # the resolved config (also saved as <run_dir>/config.yaml)
    result = run_from_hydra(cfg)
    print(f"trained {result.trainer.global_step} steps; run dir {result.run_dir}; final checkpoint "
          f"{result.final_checkpoint}", flush=True)


if __name__ == "__main__":
    main()
