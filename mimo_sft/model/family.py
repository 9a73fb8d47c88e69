"""Model families: the adapter protocol and ``ModelInfo``.

What a family is and which layouts it supports (name, ``model_type`` values, modalities, parallel
limits) is data in its descriptor, ``config.families.FamilySpec``. How it is built (config.json ->
megatron configs, which vision module to wrap, how weights are named and laid out) lives in one
adapter file per family whose ``FamilyAdapter`` subclass points at that descriptor (``spec = ...``);
``model.registry`` finds the adapter for a config.json. The builder, export and check-model code
only talks to ``FamilyAdapter``, so adding Qwen3-VL dense is a new ``qwen3_vl.py`` with an adapter
class and one registered ``FamilySpec``, not a rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mimo_sft.config.families import FamilySpec
from mimo_sft.parallel.layout import IMAGES  # also re-exported (``mimo_sft.model.IMAGES``)


@dataclass
class ModelInfo:
    """What the rest of mimo-sft needs to know about the built model.

    ``language_config`` is the megatron ``TransformerConfig`` of the language model (DDP, schedules,
    ``finalize_model_grads`` use it); ``vision_config`` is a ``TransformerConfig`` describing the
    encoder's parallel layout and dtype, for wrapping the encoder in megatron DDP.
    """

    family: str
    model_type: str
    hf_dir: Optional[str]
    image_token_id: int
    video_token_id: Optional[int]
    vision_start_token_id: Optional[int]
    vision_end_token_id: Optional[int]
    special_token_ids: dict
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    encoder_name: str
    language_config: Any = None
    vision_config: Any = None
    hf_config: Any = None
    prefix_style: str = "legacy"
    modules_on_rank: list = field(default_factory=list)
    #: ``--encoder-balance`` (``train.encoder_balance``): every vision rank runs its tower every micro-batch
    always_encode: bool = False

    def modality_inputs(self, batch: dict) -> Optional[dict]:
        """MimoModel's ``modality_inputs`` from a design.md micro-batch (None when it has no pixels)."""
        return modality_inputs_from_batch(batch, encoder_name=self.encoder_name, always=self.always_encode)


def modality_inputs_from_batch(batch: dict, encoder_name: str = "qwen_vit", *, always: bool = False) -> Optional[dict]:
    """``{"images": {encoder_name: {"pixel_values", "image_grid_thw"}}}`` or None without images.

    Returns None when the batch has no ``pixel_values`` (language-only ranks, text-only batches),
    which MimoModel treats as "no image embeddings" -- except where a colocated bridge pads encoder
    output (``bridge_tokens_per_sample`` > 0, design.md): every rank of a bridge gather group must
    run the encoder, so zero images are passed on and the encoder returns zero rows; and with ``always``
    (``--encoder-balance``: every tower of the vision DP group joins the image exchange every micro-batch).
    """
    pv = batch.get("pixel_values")
    thw = batch.get("image_grid_thw")
    if always and (pv is None or thw is None):
        pv = torch.empty((0, 0), dtype=torch.uint8, device=batch["input_ids"].device)
        thw = torch.zeros((0, 3), dtype=torch.int64)
    if pv is None or thw is None:
        return None
    if (pv.shape[0] == 0 or thw.shape[0] == 0) and not (always or batch.get("bridge_tokens_per_sample")):
        return None
    return {IMAGES: {encoder_name: {"pixel_values": pv, "image_grid_thw": thw}}}


class FamilyAdapter:
    """One model family. Subclasses set ``spec`` and implement every method; see ``qwen2_5_vl.py``."""

    spec: FamilySpec
    encoder_name: str = "qwen_vit"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model_types(self) -> tuple:
        return self.spec.model_types

    def load_hf_config(self, hf_dir: str, raw: dict):
        """The transformers config object for ``hf_dir`` (UserError on an unreadable config)."""
        raise NotImplementedError

    def info(self, hf_cfg, *, tp: int) -> ModelInfo:
        raise NotImplementedError

    def language_transformer_config(self, hf_cfg, *, tp: int, pp: int, dtype: torch.dtype,
                                    random_init: bool, cpu_init: bool, overrides: dict):
        raise NotImplementedError

    def vision_transformer_config(self, hf_cfg, *, dtype: torch.dtype, cpu_init: bool, overrides: dict):
        raise NotImplementedError

    def language_model_params(self, hf_cfg, *, padded_vocab: int, max_seq_len: int) -> dict:
        """Extra ``GPTModel`` constructor arguments (position embedding, rotary base, ...)."""
        raise NotImplementedError

    def block_spec(self, hf_cfg, num_local_layers: int, *, attention: str = "sdpa", layer_offset: int = 0):
        """megatron ``TransformerBlockSubmodules`` for this pipeline stage's layers (global layers
        ``layer_offset ..``; a hybrid decoder's layer kinds depend on them), with the core attention
        ``attention`` names (``model.attention.BACKENDS``)."""
        raise NotImplementedError

    def encoder_class(self) -> type:
        raise NotImplementedError

    def language_model_class(self, hf_cfg) -> type:
        """The language module class MimoModel builds (megatron's ``GPTModel`` unless the family needs more)."""
        from megatron.core.models.gpt import GPTModel

        return GPTModel

    def mimo_model_class(self, hf_cfg) -> type:
        """The ``MimoModel`` class to assemble: megatron's own, placing tokens from host positions
        (``model.token_positions``), unless the family needs more."""
        from megatron.core.models.mimo import MimoModel

        from mimo_sft.model.token_positions import host_positions_class

        return host_positions_class(MimoModel)

    def encoder_params(self, hf_cfg, *, attn_implementation: str) -> dict:
        raise NotImplementedError

    def check_weights(self, ckpt, hf_cfg) -> None:
        """Raise UserError naming the first tensor the config implies that is missing or mis-shaped."""
        raise NotImplementedError

    def load_language(self, ckpt, hf_cfg, *, tp_rank: int, tp: int, layer_offset: int, num_local_layers: int,
                      pre_process: bool, post_process: bool, padded_vocab: int, experts=None):
        """This rank's language weights as groups of tensors read one after another (embeddings, then
        one decoder layer at a time: ``copy_into`` copies each before the next is read). ``experts``: this
        rank's ``model.moe_weights.ExpertSlice`` (ep and etp ranks; dense families ignore it)."""
        raise NotImplementedError

    def load_encoder(self, ckpt, hf_cfg):
        """The encoder's weights (HF names without the tower's prefix): a dict, or groups read one
        after another like ``load_language``'s (``hf_checkpoint.iter_blocks``)."""
        raise NotImplementedError

    def export(self, language_sd: dict, encoder_sd: dict, hf_cfg, *, prefix_style: str) -> dict:
        """TP=1 megatron states (no prefixes) -> HF tensors named in ``prefix_style``.

        Called on the whole state and, by the streamed export (``model.export``), on one group at a
        time: a decoder layer or vision block (every tensor under ``...layers.N.`` / ``blocks.N.``),
        or one other tensor alone; each part must convert on its own (shapes may be meta tensors)."""
        raise NotImplementedError

    def projector_param(self, name: str) -> bool:
        """True for encoder parameters that belong to the projector (frozen by --freeze-projector)."""
        raise NotImplementedError

    @staticmethod
    def passthrough(name: str) -> bool:
        """Source tensors the model does not build that an export copies as they are (none by default)."""
        return False
