"""bitsandbytes' quantization, optional: a 4-bit or 8-bit base (`--quantization 4bit|8bit`, QLoRA) and 8-bit AdamW
moments (`--optim adamw_8bit`). bitsandbytes is an optional package that an entry point keeps hidden until a flag asks
for it (harness.fast_help.import_peft_quietly). A script hands `bnb_config(...)` to common.model.load_model, which
loads a base with any transformers quantization config."""

import sys

import torch
from peft.import_utils import is_bnb_4bit_available, is_bnb_available
from transformers import BitsAndBytesConfig
from transformers.utils.import_utils import is_bitsandbytes_available

from common.model import pick_device, resolve_dtype
from harness.fast_help import HIDDEN, require


def import_bitsandbytes(hint: str):
    """bitsandbytes, or a one-line install hint naming `hint` (the flag that asks for it). Hidden by an entry point
    (HIDDEN), it comes back without what PEFT and transformers cached of it while it was hidden."""
    if "bitsandbytes" in HIDDEN:
        HIDDEN.discard("bitsandbytes")
        sys.modules.pop("bitsandbytes", None)
        for cached in (is_bnb_available, is_bnb_4bit_available, is_bitsandbytes_available):
            cached.cache_clear()
    return require("bitsandbytes", hint)


def bnb_config(quantization: str | None, dtype: str) -> BitsAndBytesConfig | None:
    """None (no quantization), or the BitsAndBytesConfig of "4bit" (QLoRA's NF4 with double quantization) or "8bit",
    computing in the load dtype (`dtype` as load_model takes it: "auto", "bf16", ...); bitsandbytes runs on a CPU too.
    """
    if quantization is None:
        return None
    import_bitsandbytes(f"--quantization {quantization}")
    return BitsAndBytesConfig(
        load_in_4bit=quantization == "4bit",
        load_in_8bit=quantization == "8bit",
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=resolve_dtype(dtype, pick_device()),
    )


def adamw_8bit(model, params, lr: float, weight_decay: float):
    """transformers' `--optim adamw_8bit`: bitsandbytes' AdamW (optim_bits=8, not paged) with torch's AdamW betas
    (0.9, 0.999) and eps 1e-8, the same update on moments stored as uint8 codes of a dynamic map with an fp32 absmax
    per 256 elements. A tensor under 4096 elements (bitsandbytes' min_8bit_size) and, as transformers' Trainer sets
    them, the model's nn.Embedding weights keep fp32 moments."""
    bnb = import_bitsandbytes("--optim adamw_8bit")
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()  # overrides are keyed by id(): a freed model's entry would otherwise apply to a new tensor
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.override_config(module.weight, "optim_bits", 32)
    return bnb.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, optim_bits=8, is_paged=False
    )
