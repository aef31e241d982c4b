"""OnlyOne's core: the dual-adapter model and its log-probs, data and chat templates, rule rewards, HF rollouts."""

# Optional packages an entry point hid until a flag asks for them (harness.fast_help: bitsandbytes), for
# common.model.require to bring back. Nothing else here: importing the package costs nothing.
HIDDEN = set()
