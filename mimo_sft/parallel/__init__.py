"""Rank layout (pure arithmetic) and the one place that creates process groups.

``layout`` and ``components`` import neither torch.distributed nor megatron, so ``validate`` stays
fast and they are unit-tested without processes. ``groups`` builds HyperCommGrids and every process
group; ``cpu_shims`` is the only module that patches megatron for CPU runs.
"""
