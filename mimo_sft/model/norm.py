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
import torch.nn.functional as F


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


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Qwen3.5's RMSNorm: ``x_hat * (1 + w)`` computed in fp32 and cast back to the input's dtype,
    with ``w`` initialised to zeros (transformers' ``Qwen3_5RMSNorm``).

    Why our own: megatron's local ``WrappedTorchNorm`` asserts ``layernorm_zero_centered_gamma`` off,
    and torch's RMSNorm multiplies by ``w`` in the input's dtype. The weight is marked like
    :class:`RMSNorm`'s, so megatron sums its gradient over TP under sequence parallelism (and, as
    q/k norms, always: its ``qk_layernorm`` rule reads the name).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        assert config.normalization == "RMSNorm", f"ZeroCenteredRMSNorm built for normalization={config.normalization}"
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GatedOutputRMSNorm(torch.nn.Module):
    """The Gated DeltaNet output norm over one value head: ``w * x_hat`` (plain weight, ones at init),
    ``x_hat`` in fp32 cast back to the input's dtype before the weight, as transformers'
    ``Qwen3_5RMSNormGated`` does; megatron's GDN multiplies by ``silu(z)`` after it.

    Each TP rank normalises only its own value heads, so with tp > 1 its weight's gradient is a
    partial sum whether or not sequence parallelism is on. megatron's ``finalize_model_grads`` sums
    norms over TP only under sequence parallelism (and q/k norms by name), so the weight carries
    ``tp_partial_grad``: ``train.step`` sums every such gradient over the language TP group after
    megatron's finalize (without it the replicated weights drift apart, tested).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.weight.tp_partial_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
