"""Model sizes and parameter counts per module and rank, from a config.json dict alone.

Why a file of its own: the forecast (``memory.forecast``) needs, for each module's most loaded rank,
how many parameters it holds and how many of them train; those counts must equal what
``model.builder`` builds (megatron's local-spec ``GPTModel`` under TP and PP, transformers' vision
tower, ``model.lora``'s adapters), and ``tests/test_memory.py`` checks them against built models.

Pure: no torch, no megatron, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo_sft.config.families import Architecture, default_family, family_for_model_type
from mimo_sft.config.lora import LoraSpec
from mimo_sft.errors import UserError

#: ``text_config.layer_types`` values of Qwen3.5's hybrid decoder
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


def architecture_of(config: dict) -> Architecture:
    """The layer shapes of config.json's family (the default family's for an unknown ``model_type``)."""
    return (family_for_model_type(config.get("model_type")) or default_family()).architecture


@dataclass(frozen=True)
class GdnDims:
    """A Gated DeltaNet layer's sizes (Qwen3.5's ``linear_*`` keys)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def qk(self) -> int:
        """Width of q (and of k): key heads x key head dim."""
        return self.key_heads * self.key_dim

    @property
    def v(self) -> int:
        """Width of v (and of the output gate z): value heads x value head dim."""
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        """The depthwise conv runs over q, k and v."""
        return 2 * self.qk + self.v

    def in_proj_rows(self, tp: int) -> int:
        """megatron's fused ``in_proj`` on one tp rank: q, k, v, z, beta and alpha, each split by heads."""
        return 2 * (self.qk // tp) + 2 * (self.v // tp) + 2 * (self.value_heads // tp)

    @classmethod
    def from_text_config(cls, t: dict) -> "GdnDims":
        """Absent keys take transformers' ``Qwen3_5TextConfig`` defaults, as transformers would read them."""
        return cls(key_heads=t.get("linear_num_key_heads", 16), value_heads=t.get("linear_num_value_heads", 32),
                   key_dim=t.get("linear_key_head_dim", 128), value_dim=t.get("linear_value_head_dim", 128),
                   conv_kernel=t.get("linear_conv_kernel_dim", 4))


def hybrid_layer_types(t: dict) -> tuple[str, ...]:
    """Each layer's token mixer: ``layer_types``, or (like transformers) every ``full_attention_interval``-th
    layer (default 4) full attention and the rest Gated DeltaNet."""
    layers = t["num_hidden_layers"]
    types = t.get("layer_types")
    if types is None:
        every = t.get("full_attention_interval", 4)
        types = [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or set(types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise UserError(f"config.json text_config.layer_types must list {layers} entries (num_hidden_layers), each "
                        f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}; got {list(types)}")
    return types


@dataclass(frozen=True)
class TextDims:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = True
    qk_norm: bool = False
    #: DeepStack features per image token beside the main embedding (the bridge carries 1 + k)
    deepstack: int = 0
    #: Qwen3.5's hybrid decoder: each layer's token mixer (``FULL_ATTENTION`` or ``LINEAR_ATTENTION``, a
    #: Gated DeltaNet), the GDN sizes, and the per-head output gate the attention layers' q projection
    #: carries (``heads * head_dim`` more rows); empty / None / False for a decoder of attention layers only
    layer_types: tuple[str, ...] = ()
    gdn: GdnDims | None = None
    attn_gate: bool = False
    #: rotary channels per attention head where only part of each head rotates (Qwen3.5's
    #: ``partial_rotary_factor`` 0.25: 64 of 256, megatron's ``rotary_percent``); 0: every channel
    rotary_dim: int = 0
    #: the decoder's RMSNorms are torch's ``nn.RMSNorm`` (``model.norm.RMSNorm``: Qwen2.5-VL, Qwen3-VL), which
    #: CUDA torch runs as one fused kernel keeping less for backward than the CPU's composite
    #: (``memory.activations.norm_bytes``); False: Qwen3.5's zero-centred norms, one ``F.rms_norm`` over an fp32
    #: copy of the input (``memory.activations.decoder_norm_bytes``)
    torch_norm: bool = True
    #: a mixture-of-experts decoder: routed experts, picked per token, their FFN width, and the sparse layers
    #: (``config.families.sparse_layer_indexes``); 0 / empty for a dense decoder
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    sparse: frozenset = frozenset()
    #: Qwen3.5-MoE's shared expert on every sparse layer (FFN width; 0: none) with its [1, h] sigmoid gate
    shared_ffn: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "TextDims":
        t = config.get("text_config", config)
        heads = t["num_attention_heads"]
        tied = bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
        arch = architecture_of(config)
        hybrid = arch.hybrid_gdn
        head_dim = t.get("head_dim") or t["hidden_size"] // heads
        partial = float((t.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                             t.get("partial_rotary_factor", 1.0)))
        # Qwen3.5-MoE has no dense MLP (and no intermediate_size): every layer is sparse
        return cls(hidden=t["hidden_size"], ffn=t.get("intermediate_size") or t.get("moe_intermediate_size", 0), layers=t["num_hidden_layers"], heads=heads,
                   kv_heads=t.get("num_key_value_heads") or heads, head_dim=head_dim, vocab=t["vocab_size"], tied=tied,
                   rotary_dim=int(head_dim * partial) if partial < 1 else 0,
                   qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm,
                   deepstack=len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ())
                   if arch.deepstack else 0,
                   layer_types=hybrid_layer_types(t) if hybrid else (),
                   gdn=GdnDims.from_text_config(t) if hybrid else None, attn_gate=hybrid, torch_norm=not hybrid,
                   **(_moe_fields(t) if arch.moe else {}))

    def is_sparse(self, index) -> bool:
        return index is not None and index in self.sparse

    def padded_vocab(self, tp: int) -> int:
        """megatron's embedding rows: the vocabulary padded to a multiple of tp (``decoder_weights.pad_vocab``)."""
        return -(-self.vocab // tp) * tp

    @property
    def qkv_width(self) -> int:
        """megatron's fused ``linear_qkv`` rows: q (and its output gate), k, v."""
        return (self.heads * (2 if self.attn_gate else 1) + 2 * self.kv_heads) * self.head_dim

    def layer_type(self, index: int) -> str:
        """The token mixer of global layer ``index``."""
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def stage_layers(self, pp: int, stage: int) -> range:
        """The global layer indices of pipeline stage ``stage`` (megatron's even split)."""
        n = self.layers // pp
        return range(stage * n, (stage + 1) * n)


def _moe_fields(t: dict) -> dict:
    from mimo_sft.config.families import routed_experts, sparse_layer_indexes

    return dict(experts=routed_experts(t) or 0, topk=t.get("num_experts_per_tok", 0),
                expert_ffn=t.get("moe_intermediate_size", 0), sparse=sparse_layer_indexes(t),
                shared_ffn=t.get("shared_expert_intermediate_size") or 0)


@dataclass(frozen=True)
class VisionDims:
    hidden: int
    ffn: int
    depth: int
    heads: int
    out_hidden: int
    patch: int
    merge: int
    temporal: int
    in_channels: int
    #: the family's layer shapes (``config.families.Architecture``)
    layer_norm: bool = False
    gated_mlp: bool = True
    patch_bias: bool = False
    pos_embeddings: int = 0
    deepstack: int = 0
    #: Qwen2.5-VL's windowed blocks: the window's side in pixels (0: every block attends over whole images) and
    #: how many blocks attend over whole images all the same (``fullatt_block_indexes``)
    window: int = 0
    full_attention_blocks: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "VisionDims":
        v = config["vision_config"]
        arch = architecture_of(config)
        window = int(v.get("window_size") or 0)
        return cls(hidden=v["hidden_size"], ffn=v["intermediate_size"], depth=v["depth"], heads=v["num_heads"],
                   out_hidden=v["out_hidden_size"], patch=v["patch_size"], merge=v["spatial_merge_size"],
                   temporal=v.get("temporal_patch_size", 2), in_channels=v.get("in_channels", v.get("in_chans", 3)),
                   layer_norm=arch.vision_layer_norm, gated_mlp=arch.vision_gated_mlp, patch_bias=arch.vision_patch_bias,
                   pos_embeddings=int(v.get("num_position_embeddings", 0)) if arch.vision_pos_embed else 0,
                   deepstack=len(v.get("deepstack_visual_indexes") or ()) if arch.deepstack else 0,
                   window=window,
                   full_attention_blocks=len(v.get("fullatt_block_indexes") or ()) if window else v["depth"])

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def norm_params(self, width: int) -> int:
        return 2 * width if self.layer_norm else width

    @property
    def patch_values(self) -> int:
        """Values per patch in ``pixel_values`` (1176 for Qwen2.5-VL)."""
        return self.in_channels * self.temporal * self.patch * self.patch

    @property
    def merged(self) -> int:
        """The merger's input width (hidden x merge^2)."""
        return self.hidden * self.merge ** 2


# ---- language: parameters of one pipeline stage on one tensor rank -----------------------------
def _gdn_mixer_params(g: GdnDims, hidden: int, tp: int) -> int:
    """A Gated DeltaNet on one tp rank: column-parallel fused in_proj, the depthwise conv weight
    ``[channels/tp, 1, kernel]`` (no bias), A_log and dt_bias (one per value head, split by heads), the
    replicated gated RMSNorm over the value head dim, row-parallel out_proj."""
    return (hidden * g.in_proj_rows(tp) + g.conv_channels // tp * g.conv_kernel + 2 * (g.value_heads // tp)
            + g.value_dim + g.v // tp * hidden)


def expert_params(d: TextDims, *, ep: int = 1, etp: int = 1) -> int:
    """One sparse layer's experts on one rank: ``experts / ep`` gated MLPs, each fc1 [2 x ffn/etp, h] and
    fc2 [h, ffn/etp] (no biases)."""
    return d.experts // ep * 3 * d.hidden * (d.expert_ffn // etp)


def language_layer_params(d: TextDims, tp: int, layer_type: str = FULL_ATTENTION, *, index: int | None = None,
                          ep: int = 1, etp: int | None = None) -> int:
    """One decoder layer on one tp rank: two replicated RMSNorms, the token mixer, column-parallel fused
    gate/up, row-parallel down (no other biases). Attention: column-parallel fused QKV (with its bias,
    Qwen2/2.5; or replicated q/k RMSNorms over the head dim, Qwen3; Qwen3.5's q rows doubled by the output
    gate), row-parallel output projection. Qwen3.5's ``linear_attention`` layers: a Gated DeltaNet. A sparse
    layer (global ``index`` in ``d.sparse``): the replicated router ``[experts, h]`` and this rank's experts
    (``ep``, ``etp``: default tp) in place of the dense MLP."""
    mlp = 3 * d.hidden * (d.ffn // tp)
    if d.is_sparse(index):
        shared = 3 * d.hidden * (d.shared_ffn // tp) + d.hidden if d.shared_ffn else 0  # tp-split, and its gate
        mlp = d.experts * d.hidden + expert_params(d, ep=ep, etp=tp if etp is None else etp) + shared
    if layer_type == LINEAR_ATTENTION:
        return 2 * d.hidden + _gdn_mixer_params(d.gdn, d.hidden, tp) + mlp
    qkv = d.qkv_width // tp
    extra = (qkv if d.qkv_bias else 0) + (2 * d.head_dim if d.qk_norm else 0)
    return 2 * d.hidden + qkv * d.hidden + extra + d.hidden * (d.heads * d.head_dim // tp) + mlp


def language_stage_params(d: TextDims, *, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None) -> int:
    """Parameters on one rank of language pipeline stage ``stage``: its layers (each by its own type), the
    embedding on the first stage, final norm and output layer on the last (a tied model keeps a copy of the
    embedding there when pp > 1, which megatron keeps equal by an all-reduce)."""
    n = sum(language_layer_params(d, tp, d.layer_type(i), index=i, ep=ep, etp=etp) for i in d.stage_layers(pp, stage))
    table = d.padded_vocab(tp) // tp * d.hidden
    if stage == 0:
        n += table
    if stage == pp - 1:
        n += d.hidden + (table if (not d.tied or pp > 1) else 0)
    return n


def language_stage_expert_params(d: TextDims, *, tp: int, pp: int, stage: int, ep: int = 1,
                                 etp: int | None = None) -> int:
    """The experts among :func:`language_stage_params` (routers excluded): megatron's distributed optimizer
    shards them over the expert data-parallel ranks, the rest over the data-parallel ranks."""
    return sum(expert_params(d, ep=ep, etp=tp if etp is None else etp) for i in d.stage_layers(pp, stage)
               if d.is_sparse(i))


def language_params(d: TextDims) -> int:
    """The whole language model (tp 1, pp 1; unpadded vocabulary)."""
    table = d.vocab * d.hidden
    layers = sum(language_layer_params(d, 1, d.layer_type(i), index=i) for i in range(d.layers))
    return layers + table + d.hidden + (0 if d.tied else table)


def language_active_params(d: TextDims) -> int:
    """:func:`language_params` with each sparse layer counting only the ``topk`` experts a token runs through
    (the MFU figure's active parameters)."""
    inactive = sum(expert_params(d) * (d.experts - d.topk) // max(d.experts, 1) for i in range(d.layers)
                   if d.is_sparse(i))
    return language_params(d) - inactive


def language_lora_params(d: TextDims, lora: LoraSpec, tp: int, layer_type: str = FULL_ATTENTION,
                         index: int | None = None) -> int:
    """Adapters of one layer of ``layer_type`` on one tp rank (``model.lora``: column-parallel A whole and
    B split; row-parallel A split and B whole). The MLP targets adapt every layer; the mixer targets
    ``linear_qkv`` / ``linear_proj`` adapt an attention layer's fused q(+gate)/k/v and output projection,
    and a Gated DeltaNet layer's ``in_proj`` (column) and ``out_proj`` (row) (``config.lora``)."""
    r, h = lora.rank, d.hidden
    per = {"linear_fc1": r * h + 2 * d.ffn // tp * r,
           "linear_fc2": r * (d.ffn // tp) + h * r}
    if layer_type == LINEAR_ATTENTION:
        per.update(linear_qkv=r * h + d.gdn.in_proj_rows(tp) * r, linear_proj=r * (d.gdn.v // tp) + h * r)
    else:
        per.update(linear_qkv=r * h + d.qkv_width // tp * r, linear_proj=r * (d.heads * d.head_dim // tp) + h * r)
    if d.is_sparse(index):  # a mixture-of-experts layer: no MLP adapters (``model.lora``)
        per.pop("linear_fc1"), per.pop("linear_fc2")
    return sum(per.get(t, 0) for t in lora.language)


def language_stage_lora_params(d: TextDims, lora: LoraSpec, *, tp: int, pp: int, stage: int) -> int:
    """Adapters of every layer of pipeline stage ``stage`` on one tp rank, each layer by its type."""
    return sum(language_lora_params(d, lora, tp, d.layer_type(i), index=i) for i in d.stage_layers(pp, stage))


# ---- vision tower (unsharded) ----------------------------------------------------------------------
def vision_block_params(v: VisionDims) -> int:
    h, i = v.hidden, v.ffn
    up = (v.mlp_matrices - 1) * (i * h + i)  # gate and up (gated), or linear_fc1
    return 2 * v.norm_params(h) + (3 * h * h + 3 * h) + (h * h + h) + up + (h * i + h)


def _merger_params(v: VisionDims, norm_width: int) -> int:
    c = v.merged
    return v.norm_params(norm_width) + c * c + c + v.out_hidden * c + v.out_hidden


def projector_params(v: VisionDims) -> int:
    """The patch merger (norm over the block width), and each DeepStack merger (norm over the merged width)."""
    return _merger_params(v, v.hidden) + v.deepstack * _merger_params(v, v.merged)


def vision_params(v: VisionDims) -> tuple[int, int]:
    """``(tower, projector)`` parameters: patch embedding (its bias, the learned position table) and
    blocks; the mergers."""
    embed = v.hidden * v.patch_values + (v.hidden if v.patch_bias else 0) + v.pos_embeddings * v.hidden
    return embed + v.depth * vision_block_params(v), projector_params(v)


def vision_lora_params(v: VisionDims, lora: LoraSpec) -> int:
    r, h, i, c = lora.rank, v.hidden, v.ffn, v.merged
    n = 0
    if "vision_attn" in lora.targets:
        n += v.depth * ((r * h + 3 * h * r) + (r * h + h * r))
    if "vision_mlp" in lora.targets:
        n += v.depth * ((v.mlp_matrices - 1) * (r * h + i * r) + (r * i + h * r))
    if "merger" in lora.targets:
        n += (1 + v.deepstack) * ((r * c + c * r) + (r * c + v.out_hidden * r))
    return n


@dataclass(frozen=True)
class ModuleParams:
    """A module's whole parameter count and its most loaded rank's: held and trained."""

    total: int
    rank: int
    rank_trainable: int


def vision_module_params(v: VisionDims, model_cfg, lora: LoraSpec | None) -> ModuleParams:
    """What ``model.builder._freeze`` and ``model.lora.apply_lora`` leave trainable in the tower."""
    tower, proj = vision_params(v)
    adapters = vision_lora_params(v, lora) if lora else 0
    targets = set(lora.targets) if lora else set()
    tower_trains = not model_cfg.freeze_vision and not targets & {"vision_attn", "vision_mlp"}
    proj_trains = not model_cfg.freeze_projector and "merger" not in targets
    trainable = (tower if tower_trains else 0) + (proj if proj_trains else 0) + adapters
    return ModuleParams(tower + proj + adapters, tower + proj + adapters, trainable)
