"""DeepStack (Qwen3-VL): vision features added to the language hidden states after the first decoder layers.

Why this shape: megatron's MIMO path carries ONE tensor per modality from the encoder to the language
model (through ``BridgeCommunicator`` / ``ColocatedBridgeCommunicator`` when the modules sit on other
ranks), and ``MimoModel.align_embeddings_by_token_positions`` checks only the row count before its
``masked_scatter_``: a tensor wider than the hidden size would pass and scatter wrong values. So the
Qwen3-VL encoder returns one tensor per image-token row, ``[main | deepstack_0 | ... | deepstack_{k-1}]``
(width ``hidden * (1 + k)``, main first, in ``deepstack_visual_indexes`` order), the bridges move it as
any encoder output, and on the language side :func:`split_deepstack` -- the one place that reads that
layout -- asserts the width and splits it:

* ``main`` goes to megatron's ``align_embeddings_by_token_positions`` (``DeepStackMimoModel``);
* ``deepstack_j`` is added to the language hidden states at the image-token positions right after
  decoder layer ``j`` (global layer index, j = 0..k-1), as transformers' ``Qwen3VLTextModel`` does
  (``hidden[mask] = hidden[mask] + deepstack_j``): :class:`DeepStackLanguageMixin`.

The positions are the image tokens of the ``input_ids`` the alignment sees, in batch-major order (the
encoder's row order), mapped onto the decoder's sequence-first ``[S, B, H]`` hidden states.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch


def split_deepstack(features: torch.Tensor, *, hidden: int, num_deepstack: int):
    """``[rows, hidden*(1+k)]`` -> ``(main [rows, hidden], [deepstack_j [rows, hidden]] * k)``.

    A tensor of another width is an error (never a silent scatter). Zero rows of width ``hidden``
    are accepted too: megatron's MIMO sends ``[0, hidden]`` for a text-only micro-batch on a
    non-colocated layout (``MimoModel._empty_encoder_output``); they carry no feature.
    """
    width = hidden * (1 + num_deepstack)
    if features.shape[0] == 0 and features.shape[-1] in (hidden, width):
        empty = features[:, :hidden]
        return empty, [empty for _ in range(num_deepstack)]
    if features.dim() != 2 or features.shape[-1] != width:
        raise AssertionError(
            f"DeepStack encoder output has shape {tuple(features.shape)}; expected [rows, {width}] = [main | "
            f"{num_deepstack} deepstack features] of hidden size {hidden}")
    parts = torch.split(features, hidden, dim=-1)
    return parts[0], list(parts[1:])


@dataclass
class DeepStackInputs:
    """One micro-batch's deepstack features and where they go (sequence-first indices)."""

    seq_index: torch.Tensor  # [rows] position s of each image token in [S, B, H]
    batch_index: torch.Tensor  # [rows] sample b of each image token
    features: list  # k tensors [rows, hidden]


def deepstack_inputs(input_ids: torch.Tensor, image_token_id: int, features: list) -> Optional[DeepStackInputs]:
    """Where each deepstack row goes: the image tokens of ``input_ids [B, S]`` in batch-major order."""
    batch_index, seq_index = (input_ids == image_token_id).nonzero(as_tuple=True)
    rows = int(batch_index.shape[0])
    assert all(f.shape[0] == rows for f in features), (
        f"{rows} image tokens but deepstack features of {[tuple(f.shape) for f in features]}")
    return DeepStackInputs(seq_index=seq_index, batch_index=batch_index, features=features)


def add_deepstack(hidden_states: torch.Tensor, inputs: DeepStackInputs, j: int) -> torch.Tensor:
    """``hidden_states [S, B, H]`` with ``deepstack_j`` added at the image-token positions (out of place)."""
    feat = inputs.features[j].to(hidden_states.dtype)
    return hidden_states.index_put((inputs.seq_index, inputs.batch_index), feat, accumulate=True)


class DeepStackLanguageMixin:
    """For a megatron ``GPTModel`` subclass: adds the pending deepstack features after layers 0..k-1.

    ``set_deepstack`` is called by ``DeepStackMimoModel`` just before the language model's forward;
    each decoder layer of this stage whose global index is < k gets a forward hook that adds its
    feature to the layer's output hidden states. A stage without those layers (pipeline stage > 0)
    never sees a feature.
    """

    def init_deepstack(self, num_deepstack: int) -> None:
        self.num_deepstack = int(num_deepstack)
        self._deepstack: Optional[DeepStackInputs] = None
        for layer in self.decoder.layers:
            j = layer.layer_number - 1  # megatron's layer_number is global and 1-based
            if j < self.num_deepstack:
                layer.register_forward_hook(self._deepstack_hook(j))

    def set_deepstack(self, inputs: Optional[DeepStackInputs]) -> None:
        self._deepstack = inputs

    def _deepstack_hook(self, j: int):
        def hook(module, args, output):
            if self._deepstack is None:
                return output
            hidden, *rest = output if isinstance(output, tuple) else (output,)
            hidden = add_deepstack(hidden, self._deepstack, j)
            return (hidden, *rest) if isinstance(output, tuple) else hidden

        return hook


@functools.lru_cache(maxsize=None)
def deepstack_mimo_model_class(image_module: str, num_deepstack: int):
    """megatron's ``MimoModel`` whose alignment splits ``image_module``'s encoder output first.

    ``align_embeddings_by_token_positions`` is where megatron's MIMO (colocated and non-colocated,
    first language stage) meets the encoder output after the bridges: the subclass splits it there
    (:func:`split_deepstack`), hands ``main`` on to megatron's alignment and the deepstack features to
    the language model (``set_deepstack``); a micro-batch without image features clears them.
    """
    from megatron.core.models.mimo import MimoModel
    from megatron.core.utils import unwrap_model

    class DeepStackMimoModel(MimoModel):
        def align_embeddings_by_token_positions(self, modality_embeddings, input_ids, special_token_ids):
            lm = unwrap_model(self.language_model)
            pending = None
            features = modality_embeddings.get(image_module)
            if features is not None:
                main, deepstack = split_deepstack(features, hidden=lm.config.hidden_size, num_deepstack=num_deepstack)
                modality_embeddings = {**modality_embeddings, image_module: main}
                pending = deepstack_inputs(input_ids, special_token_ids[image_module], deepstack)
            lm.set_deepstack(pending)
            return super().align_embeddings_by_token_positions(modality_embeddings, input_ids, special_token_ids)

    DeepStackMimoModel.__qualname__ = DeepStackMimoModel.__name__
    return DeepStackMimoModel
