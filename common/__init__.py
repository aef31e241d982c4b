"""OnlyOne's core: the dual-adapter model and its log-probs, data and chat templates, rule rewards, HF rollouts."""
