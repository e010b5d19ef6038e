"""QLoRA: the frozen base weights of the LoRA linears stored as torchao's NF4 (``[lora] quantize_base``).

A LoRA linear (lora.py) keeps its base ``weight`` frozen; QLoRA stores that weight as torchao's ``NF4Tensor``
(``to_nf4``'s defaults: about 0.52 bytes per value instead of 4) while the adapters train in the compute dtype; the
forward is torchao's ``linear_nf4``. The weights are quantized from their real values after the run's start-up
loaded them (``quantize_base_weights``, at the end of checkpoint/post_load.py), one at a time; under FSDP2 each
rank gathers a whole weight, quantizes it as one process would and keeps its row chunk.

Why after the load and not on the meta device, the FSDP2 divisibility rule, checkpoints and resume, and the
layouts and known limits: docs/fine-tuning.md, "QLoRA" and "How QLoRA quantizes".
"""

from __future__ import annotations

import inspect
import logging
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dtrain.errors import ConfigError
from dtrain.parallelize import model_fqn
from dtrain.parallelize.lora_parallel import is_lora_linear
from dtrain.parallelize.memory import stored_bytes
from dtrain.precision.lora import LoRASettings, LoRATraining
from dtrain.step.torchao_import import quiet_torchao_import

with quiet_torchao_import():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

logger = logging.getLogger("dtrain")

# torchao's defaults, read from to_nf4 itself: values per NF4 block (one absmax scale each), and scales per block of
# the second quantization (one float factor each).
_DEFAULTS = inspect.signature(to_nf4).parameters
BLOCK_SIZE: int = _DEFAULTS["block_size"].default
SCALER_BLOCK_SIZE: int = _DEFAULTS["scaler_block_size"].default
VALUES_PER_SCALE_BLOCK = BLOCK_SIZE * SCALER_BLOCK_SIZE
NF4_CODES = 16  # the lookup table of the 4-bit codes, in the weight's dtype


def nf4_bytes(numel: int, dtype: torch.dtype = torch.float32) -> int:
    """The bytes torchao's NF4Tensor of `numel` values of `dtype` holds: two 4-bit codes per byte, an int8 scale per
    block, a `dtype` factor per scale block, the scales' mean and the code table."""
    itemsize = dtype.itemsize
    codes, scales, factors = numel // 2, numel // BLOCK_SIZE, numel // VALUES_PER_SCALE_BLOCK
    return codes + scales + (factors + 1 + NF4_CODES) * itemsize


def is_nf4(tensor: torch.Tensor) -> bool:
    return isinstance(tensor.to_local() if isinstance(tensor, DTensor) else tensor, NF4Tensor)


def _base_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {model_fqn(name): m for name, m in model.named_modules() if is_lora_linear(m)}


def check_nf4_shapes(model: nn.Module, shards: int = 1) -> None:
    """Refuse, in one line, a LoRA base weight of `model` (meta is enough) that torchao cannot store as NF4, or whose
    NF4 form cannot be split evenly among `shards` FSDP2 shards (rows, and scale blocks of 64 x 256 values)."""
    for fqn, module in _base_linears(model).items():
        rows, cols = module.weight.shape
        numel = rows * cols
        where = f"lora.quantize_base: {fqn}.weight [{rows}, {cols}]"
        if numel % VALUES_PER_SCALE_BLOCK:
            raise ConfigError(
                f"{where} has {numel} values, not a multiple of {VALUES_PER_SCALE_BLOCK} (torchao NF4's blocks of "
                f"{BLOCK_SIZE} values, their scales in blocks of {SCALER_BLOCK_SIZE}); leave it out of "
                "lora.target_modules or set lora.quantize_base = false"
            )
        scale_blocks = numel // VALUES_PER_SCALE_BLOCK
        if shards > 1 and (rows % shards or scale_blocks % shards):
            raise ConfigError(
                f"{where} cannot be split among {shards} FSDP shards as NF4 ({rows} rows and {scale_blocks} scale "
                f"blocks of {VALUES_PER_SCALE_BLOCK} values must both divide by {shards}); use a data-parallel shard "
                f"degree that divides {math.gcd(rows, scale_blocks)}, or leave it out of lora.target_modules"
            )


@torch.no_grad()
def _nf4_param(weight: torch.Tensor) -> nn.Parameter:
    """`weight` (a plain tensor, or a DTensor sharded by rows) as a frozen parameter stored as NF4: the whole
    weight's quantization, this rank's row chunk of it (module doc)."""
    if not isinstance(weight, DTensor):
        return nn.Parameter(to_nf4(weight.detach().contiguous()), requires_grad=False)
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ConfigError(f"lora.quantize_base: a base weight placed {placements} on a {mesh.ndim}-D mesh is not "
                          "built (NF4 base weights are built for one process and FSDP2 over one mesh dimension)")
    whole = to_nf4(weight.full_tensor().contiguous())  # a collective: every rank of the mesh quantizes each weight
    local = torch.chunk(whole, mesh.size(), dim=0)[mesh.get_local_rank()]
    sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())
    return nn.Parameter(sharded, requires_grad=False)


def quantize_base_weights(model_parts: list[nn.Module]) -> int:
    """Store the base weight of every LoRA linear of `model_parts` as NF4 (from its present values), in place,
    before the first forward, and say so with the bytes; returns how many were quantized. A collective under FSDP2:
    every rank calls it."""
    before = sum(stored_bytes(m.weight) for part in model_parts for m in _base_linears(part).values())
    count = _quantize(model_parts)
    after = sum(stored_bytes(m.weight) for part in model_parts for m in _base_linears(part).values())
    logger.info(
        "QLoRA: %d base weights stored as NF4 from their loaded values, %.1f MiB on this rank instead of %.1f MiB",
        count, after / 2**20, before / 2**20,
    )
    return count


def _quantize(model_parts: list[nn.Module]) -> int:
    count = 0
    for part in model_parts:
        fsdp_params = _fsdp_params(part)
        for module in _base_linears(part).values():
            if is_nf4(module.weight):
                continue
            module.weight = _nf4_param(module.weight)
            fsdp_param = fsdp_params.get(id(module))
            if fsdp_param is not None:
                # FSDP2 re-reads a parameter swapped before its lazy init (as torchtune's load with assign=True
                # does), but first compares the old shard's storage with the new one's, and an NF4 tensor (a wrapper
                # subclass) has none: its record of the shard is pointed at the NF4 shard, which FSDP2 then takes.
                fsdp_param._sharded_param_data = module.weight.to_local().view(-1)
            count += 1
    return count


def _fsdp_params(part: nn.Module) -> dict[int, object]:
    """FSDP2's records of the LoRA base weights of `part`, by their module's id; refuses a part FSDP2 has already
    run a forward with (it would not re-read the swapped parameters)."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for owner in part.modules():
        group = owner._get_fsdp_state()._fsdp_param_group if isinstance(owner, FSDPModule) else None
        if group is None:
            continue
        if group._reset_sharded_params:
            raise RuntimeError("lora.quantize_base: the base weights must be quantized before the first forward")
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            if info.param_name == "weight" and is_lora_linear(info.module):
                found[id(info.module)] = fsdp_param
    return found


def nf4_base_saving(parts: list[nn.Module]) -> int:
    """The bytes this rank's LoRA base weights of `parts` (their local shards; meta is enough) take less as NF4
    than in their dtype: what the memory estimate takes off the parameters under QLoRA."""
    saving = 0
    for part in parts:
        for module in _base_linears(part).values():
            local = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
            saving += local.numel() * local.element_size() - nf4_bytes(local.numel(), local.dtype)
    return saving


class QLoRATraining(LoRATraining):
    """The run's LoRA transform with NF4 base weights: `convert` also refuses base weights that NF4 cannot store or
    split among the run's `shards` FSDP2 shards; the quantization itself follows the start-up's load
    (`quantize_base_weights`)."""

    def __init__(self, settings: LoRASettings, shards: int) -> None:
        super().__init__(settings)
        self.shards = shards

    def convert(self, model: nn.Module) -> None:
        super().convert(model)
        check_nf4_shapes(model, self.shards)
