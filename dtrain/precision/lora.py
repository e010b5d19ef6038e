"""LoRA (low-rank adapters) as a model transform: which linears get adapters, the adapter module, its init.

Like the float8 converter, ``apply_lora`` runs on the model built on the meta device, before it is split into
pipeline stages and parallelized: every targeted ``nn.Linear`` is replaced in place (same FQN) by a
``LoRALinear``, which keeps the base ``weight`` (and ``bias``) frozen under their names, so every state-dict name
and checkpoint of the base model is unchanged, and adds ``lora_a`` (in -> rank) and ``lora_b`` (rank -> out):

    y = base(x) + scaling * lora_b(lora_a(dropout(x))),   scaling = alpha / rank  (rsLoRA: alpha / sqrt(rank))

as PEFT computes it. Init is PEFT's default, drawn per adapter from a generator seeded by (run seed, FQN), so every
layout starts from the single-process adapters. Target patterns, layouts and refusals: docs/fine-tuning.md,
"LoRA"; compile, dropout and init details: docs/fine-tuning.md, "How LoRA runs under every layout".
"""

from __future__ import annotations

import fnmatch
import logging
import math
from typing import Protocol

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.decoder import decoder_layout
from dtrain.parallelize import ParallelismError, model_fqn
from dtrain.parallelize.lora_parallel import copy_full_params, lora_tp_plan
from dtrain.parallelize.tensor_parallel import resolve_plan
from dtrain.step.rng import derive_seed

logger = logging.getLogger("dtrain")

ALL_LINEAR = "all-linear"  # PEFT's target_modules value for every linear layer but the output head


class LoRASettings(Protocol):
    """The keys of the [lora] config section the transform reads (dtrain.config.schema.LoRA)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    use_rslora: bool
    quantize_base: bool  # QLoRA: NF4 base weights (qlora.py)


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """The factor of the adapter's output: alpha / rank, or rsLoRA's alpha / sqrt(rank) (PEFT's ``scaling``)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose frozen ``weight``/``bias`` are the base layer's, plus a trainable low-rank update
    ``scaling * lora_b(lora_a(dropout(x)))`` (module doc)."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False
    ) -> None:
        weight = base.weight
        # nn.Linear's own parameters are created on the meta device (free) and replaced by the base's at once.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = weight
        self.bias = base.bias
        for param in (self.weight, self.bias):
            if param is not None:
                param.requires_grad_(False)
        factory = dict(bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_a = nn.Linear(base.in_features, rank, **factory)
        self.lora_b = nn.Linear(rank, base.out_features, **factory)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, scaling={self.scaling:g}"


def pattern_matches(pattern: str, fqn: str) -> bool:
    """Whether a target pattern matches the module at `fqn` (module doc: a suffix of its atoms, globs per atom)."""
    atoms, wanted = fqn.split("."), pattern.split(".")
    if len(wanted) > len(atoms):
        return False
    return all(fnmatch.fnmatchcase(atom, want) for atom, want in zip(atoms[-len(wanted):], wanted))


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {model_fqn(name): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def lora_targets(model: nn.Module, patterns: list[str]) -> list[str]:
    """The FQNs of the linears `patterns` select, in module order; a ConfigError naming the first pattern that
    selects no linear (and what it matched instead, or the linears there are) otherwise."""
    linears = _linears(model)
    head = decoder_layout(model).head
    selected: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            selected.update(fqn for fqn in linears if fqn != head)
            continue
        hits = [fqn for fqn in linears if pattern_matches(pattern, fqn)]
        if not hits:
            raise ConfigError(f"lora.target_modules: {pattern!r} {_what_else(model, pattern, linears)}")
        selected.update(hits)
    return [fqn for fqn in linears if fqn in selected]


def _what_else(model: nn.Module, pattern: str, linears: dict[str, nn.Linear]) -> str:
    """Why `pattern` selects no linear, for the one-line error."""
    names = [model_fqn(name) for name, _ in model.named_modules() if name]
    others = [fqn for fqn in names if pattern_matches(pattern, fqn)]
    grouped = [fqn for fqn in others if any(p.ndim == 3 for p in model.get_submodule(fqn).parameters(recurse=False))]
    if grouped:
        return (
            f"matches {grouped[0]}, routed experts held as grouped 3D weights, which LoRA does not wrap (the "
            "shared experts' and attention's linears it does)"
        )
    leaf_names = sorted({fqn.rsplit(".", 1)[-1] for fqn in linears})
    found = f"matches {others[0]}, which is not a linear; " if others else "matches no module; "
    return (
        f"{found}valid: linear names {', '.join(leaf_names)}, dotted suffixes of their module names (globs allowed), "
        f"or {ALL_LINEAR}"
    )


def apply_lora(model: nn.Module, settings: LoRASettings) -> list[str]:
    """Replace the targeted linears of `model` (on the meta device, before parallelize) by LoRALinear, in place;
    every other parameter is frozen too. Returns the FQNs wrapped."""
    if settings.rank < 1:
        raise ConfigError(f"lora.rank must be a positive integer; got {settings.rank}")
    targets = lora_targets(model, settings.target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    for fqn in targets:
        owner_name, _, attr = fqn.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        base = getattr(owner, attr)
        setattr(owner, attr, LoRALinear(base, settings.rank, settings.alpha, settings.dropout, settings.use_rslora))
    return targets


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The LoRALinear modules of `model` (a whole model or a stage, parallelized or not) by their model FQN."""
    return {model_fqn(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """PEFT's default adapter init (module doc), the same on every layout: `lora_a` from a generator seeded by
    (`seed`, its FQN), `lora_b` zeros; each rank keeps its part of the whole tensors."""
    full: dict[str, torch.Tensor] = {}
    for fqn, module in lora_modules(model).items():
        generator = torch.Generator().manual_seed(derive_seed(seed, "lora", fqn))
        lora_a = torch.empty(module.lora_a.weight.shape)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=generator)
        full[f"{fqn}.lora_a.weight"] = lora_a
        full[f"{fqn}.lora_b.weight"] = torch.zeros(module.lora_b.weight.shape)
    copy_full_params(model, full)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of `model` as whole tensors by FQN (``...wq.lora_a.weight``): copies on the CPU; a
    collective where they are sharded, so every rank of the part's mesh calls it."""
    adapters = {}
    for fqn, module in lora_modules(model).items():
        for name in ("lora_a", "lora_b"):
            weight = getattr(module, name).weight.detach()
            weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            adapters[f"{fqn}.{name}.weight"] = weight.to("cpu", copy=True)  # a copy: training goes on in place
    return adapters


def check_lora_layout(settings: LoRASettings, family, model_args, tensor_parallel_degree: int) -> nn.Module:
    """Refuse, in one line before anything is written, targets that select no linear and LoRA on a linear whose
    tensor-parallel style the adapters cannot follow (`family` a FamilySpec; on the meta model: free). Returns
    that meta model, for QLoRA's shape check (qlora.check_nf4_shapes)."""
    with torch.device("meta"):
        model = family.model.model_cls(model_args)
    apply_lora(model, settings)
    if tensor_parallel_degree > 1:
        plan = family.tp_plan(sequence_parallel=True, loss_parallel=True)
        try:
            lora_tp_plan(resolve_plan(plan, model), model)
        except ParallelismError as err:
            raise ConfigError(str(err)) from None
    return model


class LoRATraining:
    """The run's LoRA transform: `convert` for the model builder, `init` for the adapters after materializing."""

    def __init__(self, settings: LoRASettings) -> None:
        self.settings = settings

    def convert(self, model: nn.Module) -> None:
        s = self.settings
        wrapped = apply_lora(model, s)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        kinds = sorted({fqn.rsplit(".", 1)[-1] for fqn in wrapped})
        logger.info(
            "LoRA: rank %d, alpha %g (scaling %g%s), dropout %g on %d linears (%s); %s of %s parameters train, the "
            "base is frozen", s.rank, s.alpha, lora_scaling(s.rank, s.alpha, s.use_rslora),
            ", rsLoRA" if s.use_rslora else "", s.dropout, len(wrapped), ", ".join(kinds), f"{trainable:,}",
            f"{total:,}",
        )

    @staticmethod
    def init(model: nn.Module, seed: int) -> None:
        init_lora_weights(model, seed)
