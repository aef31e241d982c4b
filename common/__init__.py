"""OnlyOne shared toolbox: the dual-adapter model, numerics, data, rewards, rollouts and run plumbing."""
