"""Evaluations: GSM8K accuracy (`python -m evals.gsm8k`), IFEval instruction following (`python -m evals.ifeval`),
and a side-by-side report of eval scores and training curves (`python -m evals.report`)."""
