"""Where each modality's tokens sit in a micro-batch, computed on the host: MIMO's embedding scatter without
device reads.

Why: megatron's ``MimoModel`` finds the text tokens with ``nonzero`` (``get_text_embeddings``), checks each
modality's row count with ``mask.sum().item()`` and scatters with a mask (``align_embeddings_by_token_positions``),
counts each sample's image tokens with ``.tolist()`` for the bridge (``_attach_modality_split_sizes``) and asks
``.any().item()`` whether a text-only batch has image tokens (``_has_encoder_tokens``). On a GPU each of those is a
device sync, every micro-batch. The forward step holds the same ``input_ids`` on the host before copying them
(``train.step``), so it builds :class:`TokenPositions` there and hands it to the model
(:meth:`HostPositionsMixin.set_token_positions`); the model then gathers and scatters with host-built indices
that were copied once, asynchronously, and compares counts on the host. The values are megatron's: the same
tokens in the same (batch-major) order. A forward without positions (``check-model``, a direct call) takes
megatron's own path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mimo_sft.model.context_parallel import ContextParallelMixin
from mimo_sft.parallel.runtime import host_to


@dataclass
class TokenPositions:
    """One micro-batch's token positions per modality ("text": every token that is no special token)."""

    shape: tuple  # (B, S) of the input_ids they describe
    flat: dict  # modality -> int64 [n] positions in the flattened [B*S], batch-major (on the device)
    counts: dict  # modality -> n (host int)
    per_sample: dict  # modality -> [tokens of sample b] (host ints)
    host: dict  # modality -> int64 [n] positions on the host (deepstack's rows)

    @classmethod
    def of(cls, input_ids: torch.Tensor, special_token_ids: dict, device) -> "TokenPositions":
        """From the host ``input_ids [B, S]`` and the model's special token ids; indices moved to ``device``."""
        assert input_ids.device.type == "cpu" and input_ids.dim() == 2, (input_ids.device, tuple(input_ids.shape))
        text = torch.ones_like(input_ids, dtype=torch.bool)
        masks = {}
        for name, token in special_token_ids.items():
            masks[name] = input_ids == token
            text &= ~masks[name]
        masks = {"text": text, **masks}
        host = {name: mask.reshape(-1).nonzero().reshape(-1) for name, mask in masks.items()}
        return cls(shape=tuple(input_ids.shape), flat={name: host_to(idx, device) for name, idx in host.items()},
                   counts={name: int(idx.numel()) for name, idx in host.items()},
                   per_sample={name: mask.sum(dim=1).tolist() for name, mask in masks.items()}, host=host)

    def matches(self, input_ids: Optional[torch.Tensor]) -> bool:
        return input_ids is not None and tuple(input_ids.shape) == self.shape


class HostPositionsMixin:
    """For a ``MimoModel`` subclass: megatron's text gather, embedding scatter, bridge split sizes and
    text-only check from this micro-batch's :class:`TokenPositions` (module docstring)."""

    _token_positions: Optional[TokenPositions] = None

    def set_token_positions(self, positions: Optional[TokenPositions]) -> None:
        """The next forward's positions (the forward step sets them for every micro-batch)."""
        self._token_positions = positions

    def _positions_for(self, input_ids) -> Optional[TokenPositions]:
        positions = self._token_positions
        return positions if positions is not None and positions.matches(input_ids) else None

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._token_positions = None  # one forward's: a later call without positions takes megatron's path
            self._cp_split = None  # (model.context_parallel) likewise

    def get_text_embeddings(self, input_ids, position_ids, special_token_ids):
        positions = self._positions_for(input_ids)
        if positions is None:
            return super().get_text_embeddings(input_ids, position_ids, special_token_ids)
        from megatron.core.utils import unwrap_model

        index = positions.flat["text"]
        ids = input_ids.reshape(-1).index_select(0, index).unsqueeze(0)
        pos = None
        if position_ids is not None:
            rows = position_ids[0] if position_ids.dim() == 3 else position_ids  # mRoPE: one absolute channel
            pos = rows.reshape(-1).index_select(0, index).unsqueeze(0)
        embedding = unwrap_model(self.language_model).embedding
        assert not getattr(embedding, "scatter_to_sequence_parallel", False), (
            "MIMO scatters the combined embeddings itself: the language embedding must not (model.builder)")
        return embedding(input_ids=ids, position_ids=pos).squeeze(1)  # [text tokens, hidden]

    def align_embeddings_by_token_positions(self, modality_embeddings, input_ids, special_token_ids):
        # under context parallelism each cp rank backpropagates only its positions' rows: sum them over cp
        modality_embeddings = {name: rows if name == "text" else self.over_cp(rows)
                               for name, rows in modality_embeddings.items()}
        positions = self._positions_for(input_ids)
        if positions is None:
            return super().align_embeddings_by_token_positions(modality_embeddings, input_ids, special_token_ids)
        reference = modality_embeddings.get("text", next(iter(modality_embeddings.values())))
        batch, seq = positions.shape
        combined = reference.new_zeros((batch * seq, reference.shape[-1]))
        for name, rows in modality_embeddings.items():
            if name != "text" and name not in special_token_ids:
                raise ValueError(f"No special token ID defined for modality {name}")
            if rows.shape[0] != positions.counts[name]:
                raise ValueError(f"Number of {name} tokens ({positions.counts[name]}) does not match number of "
                                 f"{name} embeddings ({rows.shape[0]})")
            rows = rows.reshape(rows.shape[0], combined.shape[-1])  # (zero rows too: a text-only micro-batch)
            combined = combined.index_copy(0, positions.flat[name], rows.to(combined.dtype))
        return combined.view(batch, seq, -1).transpose(0, 1).contiguous()  # [S, B, H]

    def _attach_modality_split_sizes(self, output, input_ids, encoder_name):
        """megatron's per-sample split sizes for the bridge (only where they are not uniform), from host counts."""
        positions = self._positions_for(input_ids)
        if positions is None or encoder_name not in positions.per_sample:
            return super()._attach_modality_split_sizes(output, input_ids, encoder_name)
        sizes = list(positions.per_sample[encoder_name])
        if output.ndim != 2 or len(sizes) <= 1 or sum(sizes) != output.size(0) or len(set(sizes)) <= 1:
            return None
        from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY, ModuleLayout

        if self.role.mode is ModuleLayout.NON_COLOCATED:  # megatron's limit, as its own method states it
            grids = self.mimo_config.module_to_grid_map
            dp = {n: g.shape[g.dim_names.index("dp")] for n, g in
                  ((encoder_name, grids[encoder_name]), ("language", grids[MIMO_LANGUAGE_MODULE_KEY]))}
            assert dp[encoder_name] <= dp["language"], (
                f"per-sample split sizes that differ need encoder DP <= language DP (megatron's bridge); got "
                f"{encoder_name} DP {dp[encoder_name]}, language DP {dp['language']}")
        output._mimo_bridge_split_sizes = sizes
        return None

    def _has_encoder_tokens(self, input_ids, encoder_name):
        positions = self._positions_for(input_ids)
        if positions is None or encoder_name not in positions.counts:
            return super()._has_encoder_tokens(input_ids, encoder_name)
        return positions.counts[encoder_name] > 0


_CLASSES: dict = {}


def host_positions_class(base: type) -> type:
    """``base`` (megatron's ``MimoModel`` or a subclass) with :class:`HostPositionsMixin` and
    ``model.context_parallel.ContextParallelMixin`` (one class per base)."""
    if base not in _CLASSES:
        cls = type(f"HostPositions{base.__name__}", (HostPositionsMixin, ContextParallelMixin, base), {})
        cls.__qualname__ = cls.__name__
        _CLASSES[base] = cls
    return _CLASSES[base]
