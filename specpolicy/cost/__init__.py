"""Costs of decoding: analytic FLOPs (flops.py); latency profiles and the cost model come later."""
