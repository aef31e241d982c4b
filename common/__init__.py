"""OnlyOne's core: the dual-adapter model and its log-probs, data and chat templates, rule rewards, HF rollouts."""

# Packages harness.fast_help hid (bitsandbytes) for common.model.require to bring back. Nothing else: --help imports it
HIDDEN = set()
