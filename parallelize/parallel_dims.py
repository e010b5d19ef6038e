"""The parallelism degrees of a run, checked against the world size, the model and the batch.

Everything here is plain arithmetic: it runs before any process group exists, so that an impossible layout fails
in a second with one line naming the config keys, not minutes later inside a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtrain.parallelize.errors import ParallelismError

# The config key behind each degree, so that every message names what the user has to change.
CONFIG_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}

# Rows SDPA's memory-efficient CUDA kernel pads its log-sum-exp to (see check_cp_divides).
RING_CHUNK_ROWS = 32


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_list(values: list[int], limit: int = 8) -> str:
    """The first `limit` values, comma-separated, with an ellipsis when there are more."""
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the other degrees leave of the world size.

    `sequence_parallel` and `loss_parallel` only matter when `tp > 1`. Construction validates and resolves -1, so
    an existing ParallelDims always multiplies to its world size.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ParallelismError(f"the world size must be at least 1, got {self.world_size}")
        for name in CONFIG_KEYS:
            value = getattr(self, name)
            if value < 1 and not (name == "dp_shard" and value == -1):
                valid = "-1 or a positive integer" if name == "dp_shard" else "a positive integer"
                raise ParallelismError(f"{CONFIG_KEYS[name]}={value} is invalid (valid: {valid})")
        others = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelismError(
                    f"{self._describe(exclude='dp_shard')} does not divide the world size {self.world_size}, "
                    f"so {CONFIG_KEYS['dp_shard']}=-1 cannot fill the rest"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ParallelismError(
                f"{self._describe()} is not the world size {self.world_size}; "
                f"set {CONFIG_KEYS['dp_shard']}=-1 to use what the other degrees leave"
            )
        if self.ep > 1:
            self._check_ep()

    def _check_ep(self) -> None:
        """Expert parallel borrows its ranks from the FSDP ranks (dp_shard × cp), as torchtitan's does: each of
        those ranks holds 1/ep of the experts, and experts are FSDP-sharded over what is left."""
        shard_ranks = self.dp_shard * self.cp
        if shard_ranks % self.ep:
            raise ParallelismError(
                f"{CONFIG_KEYS['ep']}={self.ep} does not divide {CONFIG_KEYS['dp_shard']} × {CONFIG_KEYS['cp']} = "
                f"{shard_ranks}, the ranks expert parallel borrows (valid: {_valid_list(_divisors(shard_ranks))})"
            )

    def _describe(self, exclude: str = "") -> str:
        """`key=value × key=value = product` over the degrees above 1 that make up the world size."""
        names = [n for n in ("dp_replicate", "dp_shard", "tp", "pp", "cp") if n != exclude and getattr(self, n) > 1]
        text = " × ".join(f"{CONFIG_KEYS[n]}={getattr(self, n)}" for n in names)
        return text if len(names) == 1 else f"{text} = {math.prod(getattr(self, n) for n in names)}"

    # What is enabled. Data parallelism has one owner: fully_shard (FSDP2, or HSDP when replicated too) or, for a
    # pure replica layout, DDP. TP composes with fully_shard only, so replicate>1 with tp>1 uses HSDP whose shard
    # dimension may be 1 (each replica then holds whole TP shards, which is DDP semantics on a 2-D mesh).
    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the batch-splitting degree (replicate × shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are managed by fully_shard (FSDP2 or HSDP), which shards over dp_shard × cp."""
        return self.dp_shard * self.cp > 1 or (self.dp_replicate > 1 and self.tp_enabled)

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The ranks each expert's weights are FSDP-sharded over: dp_shard × cp less the expert-parallel ranks."""
        return self.dp_shard * self.cp // self.ep

    @property
    def sequence_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.sequence_parallel

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.loss_parallel

    def check_tp_divides(self, sizes: dict[str, int], seq_len: int) -> None:
        """Check that TP can split every one of a model's `sizes` ({what, by config key or description: size},
        given by its family: heads, kv heads, FFN width, vocabulary, ...) and, under sequence parallel, the
        sequence."""
        if not self.tp_enabled:
            return
        sizes = dict(sizes)
        if self.sequence_parallel_enabled:
            sizes["training.seq_len"] = seq_len
        valid = _divisors(math.gcd(*sizes.values()))
        for name, size in sizes.items():
            if size % self.tp:
                hint = "; or set model.args.vocab_size, or model.vocab_size_multiple_of" if "vocab" in name else ""
                raise ParallelismError(
                    f"{CONFIG_KEYS['tp']}={self.tp} does not divide {name}={size} (valid: {_valid_list(valid)}{hint})"
                )

    def check_cp_divides(self, seq_len: int, load_balancer: str, torch_ring: bool = False) -> None:
        """Check that context parallel can cut every sequence into its chunks: 2 cp of them under the head-tail
        load balancer, cp otherwise. Under torch's ring attention (`torch_ring`, CUDA) with head-tail chunks,
        each chunk must also be a multiple of 32 rows: the ring attends the second half of a rank's queries
        alone and merges that half's log-sum-exp into the whole one's, and SDPA's memory-efficient kernel pads
        its log-sum-exp to multiples of 32 rows, so any other length fails in the merge (seen on torch 2.11, an
        H100, fp32: chunks of 16 rows)."""
        if not self.cp_enabled:
            return
        chunks = 2 * self.cp if load_balancer == "headtail" else self.cp
        if seq_len % chunks:
            how = f"2 × {CONFIG_KEYS['cp']}" if load_balancer == "headtail" else CONFIG_KEYS["cp"]
            raise ParallelismError(
                f"training.seq_len={seq_len} is not a multiple of {how} = {chunks} "
                f"(parallelism.context_parallel_load_balancer={load_balancer!r} cuts each sequence into {chunks} "
                f"chunks; valid seq_len: {chunks}, {2 * chunks}, {3 * chunks}, ...)"
            )
        unit = chunks * RING_CHUNK_ROWS
        if torch_ring and load_balancer == "headtail" and seq_len % unit:
            raise ParallelismError(
                f"training.seq_len={seq_len} gives head-tail chunks of {seq_len // chunks} rows; torch's ring "
                f"attention (CUDA) needs chunks of a multiple of {RING_CHUNK_ROWS} rows, as SDPA's memory-efficient "
                f"kernel pads its log-sum-exp so (valid seq_len: {unit}, {2 * unit}, {3 * unit}, ...)"
            )

    def gradient_accumulation_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        """Microbatches per optimizer step; `global_batch_size=-1` means one microbatch on every dp rank."""
        per_step = local_batch_size * self.dp_size
        if global_batch_size == -1:
            return 1
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ParallelismError(
                f"training.global_batch_size={global_batch_size} is not a multiple of training.local_batch_size="
                f"{local_batch_size} × data-parallel size {self.dp_size} = {per_step} "
                f"(valid: -1, {per_step}, {2 * per_step}, {3 * per_step}, ...)"
            )
        return global_batch_size // per_step
