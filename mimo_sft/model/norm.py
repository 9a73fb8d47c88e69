"""The language model's RMSNorm for megatron's local layer spec, with sequence parallelism.

megatron-core 0.19.2 without Transformer Engine or apex builds its norms from ``WrappedTorchNorm``,
which asserts ``sequence_parallel`` off. With sequence parallelism each TP rank normalises only its
``1/tp`` of the positions, so the (replicated) norm weight gets only a partial gradient on each rank;
megatron's ``finalize_model_grads`` (``_allreduce_layernorm_grads``) sums over TP the gradients of
every parameter marked ``sequence_parallel=True`` when the model's config has sequence parallelism
on. ``RMSNorm`` is torch's own RMSNorm (same parameter name, same numbers, same checkpoint keys as
before) with that mark on its weight.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm constructor; its weight is reduced over TP under SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        assert config.normalization == "RMSNorm", f"mimo_sft RMSNorm built for normalization={config.normalization}"
        assert not config.layernorm_zero_centered_gamma and not config.memory_efficient_layer_norm, (
            "mimo_sft RMSNorm: zero-centred gamma and memory-efficient layer norm are not supported")
        super().__init__(hidden_size, eps=eps)  # as WrappedTorchNorm builds it (the builder casts the model)
        # read by megatron's _allreduce_layernorm_grads (finalize_model_grads) when config.sequence_parallel
        self.weight.sequence_parallel = bool(config.sequence_parallel)
