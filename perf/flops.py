"""Model FLOPs per step (PaLM appendix B convention): the formulas live in configs/flops.py,
beside the configs they read; re-exported here for the perf tools."""

from shardax.configs.flops import CONVENTION, matmul_params, per_step, per_token, score_width

__all__ = ["CONVENTION", "matmul_params", "per_step", "per_token", "score_width"]
