"""GPU memory forecast: what each module's most loaded rank needs, from config.json and the config.

``forecast.forecast_memory`` computes it (``dims`` counts parameters, ``activations`` holds the
per-token and per-patch formulas) for a ``workload.Workload``: the worst case a sample could reach, or the
largest micro-batch a dataset's per-row counts can form (``from_data``); ``fixes`` finds the cheapest change that makes a layout fit,
``gpu`` reads the local GPU's size and picks the device whose kernels are counted. Pure (no
torch.distributed, no megatron): ``validate`` and ``plan`` run it on a laptop; docs/memory.md lists the
formulas and which were measured.
"""
