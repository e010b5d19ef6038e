"""Transforms of the model once the start-up has loaded (or freshly initialised) its weights, whichever rule fired."""

from __future__ import annotations

from dtrain.checkpoint.context import RunContext


def quantize_qlora_base(ctx: RunContext) -> None:
    """QLoRA stores the frozen base quantized: it quantizes the weights just loaded (precision/qlora.py)."""
    if ctx.lora is None or not ctx.lora.enable or not ctx.lora.quantize_base:
        return
    from dtrain.precision.qlora import quantize_base_weights

    quantize_base_weights(ctx.state.model_parts)
