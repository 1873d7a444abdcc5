"""Costs of decoding: analytic FLOPs (flops.py), measured latency profiles (profile.py), the cost model that
interpolates them (model.py) and the engine's own per-step overhead (overhead.py)."""
