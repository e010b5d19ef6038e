"""torchtitan 0.2.2's own Trainer (`torchtitan.train.main`) on dtrain's batches, with dtrain's shape flags (GPU).

    torchrun --standalone --nproc_per_node 1 scripts/torchtitan_trainer.py \\
        --job.config_file FILE [--section.key V ...] [--model.args.NAME V ...] [--torchtitan_only FLAGS ...]

torchtitan's side of scripts/bench_vs_torchtitan.py on a GPU. Two things are set before torchtitan's main parses
its command line, both as tests/reference/torchtitan_train_loop.py sets them for its CPU loop:
- `--model.args.NAME V` (a shape torchtitan's CLI has no flag for, e.g. the 1B-class width on the 8B flavor) is set
  on the flavor's args;
- the data loader yields dtrain's batches for the flags before `--torchtitan_only` (dtrain's loader reads them):
  the data is an input of the comparison, so both sides train on the same tokens, and no tokenizer or dataset
  files are needed on the GPU machine.
Everything else (model, activation checkpointing, compile, float8, optimizer, schedule, checkpoint loading, the
metrics it logs) is torchtitan's. Flags after `--torchtitan_only` go to torchtitan only (its checkpoint flags for
the seed; not `--`, which torchrun's own parser takes).
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))

from torchtitan_train_loop import dtrain_batches, set_shape, split_model_args  # noqa: E402
from triton_stub import install_triton_stub  # noqa: E402


class DtrainBatches:
    """dtrain's batches in the form torchtitan's Trainer iterates, `({"input": ids}, labels)`; a benchmark never
    resumes, so its checkpointed position is empty."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def __iter__(self):
        for batch in dtrain_batches(self.argv):
            yield {"input": batch["input_ids"]}, batch["labels"]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def main(argv: list[str]) -> None:
    split = argv.index("--torchtitan_only") if "--torchtitan_only" in argv else len(argv)
    common, torchtitan_only = argv[:split], argv[split + 1 :]
    torchtitan_argv, shape = split_model_args(common)
    # Before torchtitan is imported: its ConfigManager.parse_args defaults to sys.argv as it was at import time.
    sys.argv = [sys.argv[0], *torchtitan_argv, *torchtitan_only]
    install_triton_stub()  # a no-op where triton is installed (a GPU machine); lets a CPU get to the Trainer
    import torchtitan.protocols.train_spec as train_spec_module
    import torchtitan.train
    from torchtitan.config import ConfigManager

    flavor = ConfigManager().parse_args(sys.argv[1:]).model.flavor
    get_train_spec = train_spec_module.get_train_spec

    def with_dtrain_batches(name: str):
        spec = get_train_spec(name)
        set_shape(spec.model_args[flavor], shape)
        return dataclasses.replace(
            spec, build_tokenizer_fn=None, build_dataloader_fn=lambda **_: DtrainBatches(common)
        )

    # The Trainer looks its spec up through this module attribute when it starts.
    train_spec_module.get_train_spec = with_dtrain_batches
    torchtitan.train.main(torchtitan.train.Trainer)


if __name__ == "__main__":
    main(sys.argv[1:])
