"""Tools around the training scripts (not needed to train): the TRL parity harness, importable by tests/ and bench/."""
