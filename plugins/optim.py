"""Optional optimizers: `--optim adamw_8bit`, bitsandbytes' 8-bit AdamW (bitsandbytes is an optional package,
imported when the flag asks for it)."""

import torch

from common.model import require


def adamw_8bit(model, params, lr: float, weight_decay: float):
    """transformers' `--optim adamw_8bit`: bitsandbytes' AdamW (optim_bits=8, not paged) with torch's AdamW betas
    (0.9, 0.999) and eps 1e-8, the same update on moments stored as uint8 codes of a dynamic map with an fp32 absmax
    per 256 elements. A tensor under 4096 elements (bitsandbytes' min_8bit_size) and, as transformers' Trainer sets
    them, the model's nn.Embedding weights keep fp32 moments."""
    bnb = require("bitsandbytes", "--optim adamw_8bit")
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()  # overrides are keyed by id(): a freed model's entry would otherwise apply to a new tensor
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.override_config(module.weight, "optim_bits", 32)
    return bnb.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, optim_bits=8, is_paged=False
    )
