"""Model families as data: the one place that says what a family is and which layouts it supports.

A ``FamilySpec`` holds a family's name, the config.json ``model_type`` values it reads, its
modalities (encoder module names besides ``language``) with each encoder's parallel limits, the
language model's limits, how to read the language model's heads and layers from a config.json
dict, and where its model-side adapter lives. Everything else reads these specs:

* ``config.checks`` turns the limits into the messages ``validate``, ``finetune`` and ``plan``
  print (checks 4, 10, 12 and 16), and lists the supported ``model_type`` values;
* ``config.schema`` takes the ``--model-family`` choices from :func:`family_names`;
* ``model.registry`` finds a family's adapter through :attr:`FamilySpec.adapter`, and each adapter
  points back at its spec (``spec = QWEN2_5_VL``);
* ``model.builder`` asserts :func:`layout_problems` is empty (``check_config`` refused it earlier).

Pure: imports neither torch nor megatron nor transformers, so ``validate`` stays fast.

Adding a family: one ``register(FamilySpec(...))`` here and its adapter file in ``mimo_sft/model/``
(a ``FamilyAdapter`` subclass with ``spec = THE_SPEC``, named by ``adapter=``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Optional, Union

from mimo_sft.parallel.components import ComponentSpec
from mimo_sft.parallel.layout import IMAGES, LANGUAGE

#: what the rule functions yield: an error message, or ``(message, "note")`` for a note
Finding = Union[str, tuple[str, str]]


@dataclass(frozen=True)
class LanguageDims:
    """The language model sizes a layout must divide (None: not in config.json, not checked).

    ``gdn_key_heads`` / ``gdn_value_heads``: a hybrid decoder's Gated DeltaNet head counts
    (``text_config.linear_num_key_heads`` / ``linear_num_value_heads``; megatron shards both over tp);
    None for families without GDN layers."""

    heads: Optional[int]
    kv_heads: Optional[int]
    layers: Optional[int]
    gdn_key_heads: Optional[int] = None
    gdn_value_heads: Optional[int] = None
    #: a mixture-of-experts decoder's routed experts (``text_config.num_experts``) and their FFN width
    #: (``moe_intermediate_size``); None for dense families
    experts: Optional[int] = None
    expert_ffn: Optional[int] = None


@dataclass(frozen=True)
class EncoderLimits:
    """Parallel limits of one encoder module (a modality). False: that kind of parallelism is refused."""

    #: how messages name the network and whose implementation runs
    tower: str = "vision tower"
    implementation: str = "Hugging Face Qwen-VL"
    #: tp > 1 shards the encoder
    tp: bool = False
    #: on a colocated layout, tp > 1 replicates the unsharded encoder on its tp ranks (identical inputs,
    #: outputs and gradients), which lets it run at a smaller DP than the language model on the same
    #: ranks (ColocatedBridgeCommunicator fan-out); apart from the language model it would only waste GPUs
    replicated_tp_when_colocated: bool = True
    pp: bool = False
    cp: bool = False


@dataclass(frozen=True)
class Architecture:
    """What the memory forecast's counts need to know of a family's layers (``memory.dims``,
    ``memory.activations``); the model adapters read the decoder's two flags from here too."""

    #: decoder attention: a bias on q/k/v (Qwen2/2.5), RMSNorm over the head dim of q and k (Qwen3)
    qkv_bias: bool = True
    qk_norm: bool = False
    #: vision blocks: LayerNorm with bias (else RMSNorm), a gated MLP of three matrices (else two),
    #: a bias on the patch embedding, a learned position table (``num_position_embeddings`` rows)
    vision_layer_norm: bool = False
    vision_gated_mlp: bool = True
    vision_patch_bias: bool = False
    vision_pos_embed: bool = False
    #: one extra merger per ``deepstack_visual_indexes`` entry (LayerNorm over the merged width), whose
    #: features travel with the main embedding (``hidden * (1 + k)`` per image token)
    deepstack: bool = False
    #: Qwen3.5's hybrid decoder: ``text_config.layer_types`` mixes Gated DeltaNet layers
    #: ("linear_attention") with full-attention layers whose q projection carries a per-head output gate;
    #: every RMSNorm but the GDN output norm is zero-centred (x_hat * (1 + w))
    hybrid_gdn: bool = False
    #: sparse decoder MLPs: ``text_config.num_experts`` routed experts of ``moe_intermediate_size``, top
    #: ``num_experts_per_tok`` per token, on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick
    moe: bool = False


@dataclass(frozen=True, eq=False)
class FamilySpec:
    """One model family, as data (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    #: modality module name -> its encoder's limits (the keys are the family's modalities)
    encoders: Mapping[str, EncoderLimits]
    #: the language model's heads, KV heads and layers from a config.json dict
    language_dims: Callable[[dict], LanguageDims]
    #: ``"module:Class"`` of the model-side ``FamilyAdapter`` (imported only when a model is built)
    adapter: str
    #: language context parallelism (False: cp must be 1); every family has it (``model.context_parallel``)
    language_cp: bool = True
    #: ``"module:Class"`` of the transformers model whose ``get_rope_index`` gives the family's mRoPE
    #: positions (the data path runs it on a stand-in object, ``data.preprocess``; imported lazily)
    rope_index: str = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLModel"
    #: ``"module:function"`` of the vision tower's forward FLOPs ``(vision_config, grids) -> float``
    #: (``train.flops``; pure arithmetic)
    vision_flops: str = "mimo_sft.model.vision_flops:qwen2_5_vl"
    #: the layer shapes the memory forecast counts
    architecture: Architecture = Architecture()
    #: the marked chat template (``data.processor.CHAT_TEMPLATES`` name) a folder's template must render like
    chat_template: str = "qwen2_vl"
    #: whether a clip's text names each temporal patch's time (``<t seconds>`` and its own vision_start/end, as
    #: transformers' ``Qwen3VLProcessor`` writes it); False: one run of video tokens (Qwen2.5-VL)
    video_timestamps: bool = False
    #: config.json rules of the family beyond divisibility (``config_findings``; check 16 reports them with the
    #: divisibility lines)
    config_rules: tuple[Callable[[dict], Iterator[Finding]], ...] = ()

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.encoders)

    def encoder_limits(self, module: str) -> Optional[EncoderLimits]:
        """Limits of encoder ``module``. A module that is not a modality (check 4 refuses it) is held to
        the family's first encoder's limits, so its other problems are reported too."""
        return self.encoders.get(module) or next(iter(self.encoders.values()), None)


# ---- rules (pure functions of a spec, the modules and a config.json dict) -----------------------

def encoder_findings(spec: FamilySpec, module: ComponentSpec, *, colocated: bool,
                     language_dp: Optional[int]) -> Iterator[Finding]:
    """Encoder parallelism the family refuses (check 10), and the colocated replicated-tp note."""
    lim = spec.encoder_limits(module.name)
    if lim is None:
        return
    s = module
    if s.pp > 1 and not lim.pp:
        yield f"{s.name}.pp={s.pp}: encoder pipeline parallelism is not supported (mimo-sft's own limit); set pp=1"
    if s.tp > 1 and not lim.tp:
        if colocated and lim.replicated_tp_when_colocated:
            yield (f"{s.name}.tp={s.tp} on a colocated layout: the {lim.tower} is replicated (not sharded) on its "
                   f"{s.tp} tp ranks, so {s.name}.dp={s.dp} replicas serve language.dp="
                   f"{language_dp if language_dp is not None else '?'} (fan-out)", "note")
        else:
            yield (f"{s.name}.tp={s.tp}: the {lim.implementation} {lim.tower} runs unsharded "
                   f"(mimo-sft's own limit); set tp=1 and scale the encoder with dp")
    if s.cp > 1 and not lim.cp:
        yield f"{s.name}.cp={s.cp}: encoder context parallelism is not supported; set cp=1"


def language_partition_findings(spec: FamilySpec, language: ComponentSpec) -> Iterator[Finding]:
    """Language partitions the family refuses regardless of the checkpoint (check 12)."""
    if language.cp > 1 and not spec.language_cp:
        yield f"language.cp={language.cp}: {spec.name} has no context parallelism here; set cp=1"


def language_divisibility_findings(spec: FamilySpec, language: ComponentSpec, config: dict) -> Iterator[Finding]:
    """tp must divide the attention and KV heads (and a hybrid decoder's GDN heads), pp the layers, of the
    checkpoint; then the family's own config.json rules (``config_findings``). Check 16 reports them all, and
    the memory forecast (check 23) runs only on a config.json with none, so it never reads a broken one."""
    d = spec.language_dims(config)
    s = language
    if d.heads and s.tp >= 1 and d.heads % s.tp:
        yield f"language.tp={s.tp} does not divide the model's {d.heads} attention heads; choose a divisor"
    if d.kv_heads and s.tp >= 1 and d.kv_heads % s.tp:
        yield (f"language.tp={s.tp} does not divide the model's {d.kv_heads} key/value heads; "
               f"choose a divisor of {d.kv_heads}")
    if d.layers and s.pp >= 1 and d.layers % s.pp:
        yield f"language.pp={s.pp} does not divide the model's {d.layers} layers; choose a divisor"
    for n, kind, key in ((d.gdn_key_heads, "key", "linear_num_key_heads"),
                         (d.gdn_value_heads, "value", "linear_num_value_heads")):
        if n and s.tp >= 1 and n % s.tp:
            yield (f"language.tp={s.tp} does not divide the model's {n} Gated DeltaNet {kind} heads "
                   f"(text_config.{key}); choose a divisor of {n}")
    yield from context_parallel_findings(s, d)
    yield from expert_findings(spec, s, d)
    yield from config_findings(spec, config)


def context_parallel_findings(s: ComponentSpec, d) -> Iterator[Finding]:
    """cp shares each tensor-parallel rank's heads in its all-to-all (``model.context_parallel``): it must divide
    the attention heads per tp rank (key/value heads are repeated where it does not divide them) and, as megatron's
    Gated DeltaNet splits its heads over cp the same way, the GDN key and value heads per tp rank."""
    if s.cp <= 1 or s.tp < 1:
        return
    for n, what in ((d.heads, "attention heads"), (d.gdn_key_heads, "Gated DeltaNet key heads"),
                    (d.gdn_value_heads, "Gated DeltaNet value heads")):
        if n and n % s.tp == 0 and (n // s.tp) % s.cp:
            per = n // s.tp
            choices = [c for c in range(2, per + 1) if per % c == 0]
            yield (f"language.cp={s.cp} does not divide the {per} {what} per tensor-parallel rank ({n} / tp {s.tp}); "
                   f"choose cp from {choices}" if choices else
                   f"language.cp={s.cp} does not divide the {per} {what} per tensor-parallel rank ({n} / tp {s.tp}); "
                   f"set cp=1 or lower tp")


def expert_findings(spec: FamilySpec, language: ComponentSpec, d: LanguageDims) -> Iterator[Finding]:
    """Expert parallelism against the checkpoint: ep only with experts, dividing them; etp dividing
    the experts' FFN width (megatron shards each expert's fc1/fc2 over etp)."""
    s = language
    if not d.experts:
        if s.ep > 1 or s.etp is not None and s.etp > 1:
            given = f"language.ep={s.ep}" + (f", etp={s.etp}" if s.etp is not None else "")
            yield f"{given}: {spec.name} is a dense model (no experts); set ep=1 and drop etp"
        return
    if s.ep >= 1 and d.experts % s.ep:
        yield (f"language.ep={s.ep} does not divide the model's {d.experts} experts (text_config.num_experts); "
               f"choose a divisor of {d.experts}")
    if d.expert_ffn and s.expert_tp >= 1 and d.expert_ffn % s.expert_tp:
        yield (f"language.etp={s.expert_tp} does not divide the experts' FFN width {d.expert_ffn} "
               f"(text_config.moe_intermediate_size); choose a divisor (etp defaults to tp)")


def config_findings(spec: FamilySpec, config: dict) -> Iterator[Finding]:
    """The family's own config.json rules (``FamilySpec.config_rules``; check 16)."""
    for rule in spec.config_rules:
        yield from rule(config)


def layout_problems(spec: FamilySpec, layout, config: dict) -> list[str]:
    """Every error the family's rules give for ``layout`` (a ``parallel.layout.Layout``) and a config.json
    dict: what the model builder asserts away (checks 3, 4, 10, 12 and 16 report them to the user)."""
    names = layout.names
    if LANGUAGE not in names:
        return ["the layout has no 'language' module"]
    out = [f"module '{n}' is not a modality of {spec.name}" for n in names
           if n != LANGUAGE and n not in spec.modalities]
    lang = layout.spec(LANGUAGE)
    for enc in layout.encoders:
        out += encoder_findings(spec, enc, colocated=layout.colocated, language_dp=lang.dp)
    out += language_partition_findings(spec, lang)
    out += language_divisibility_findings(spec, lang, config)
    return [f for f in out if isinstance(f, str)]


# ---- registry ----------------------------------------------------------------------------------

_FAMILIES: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` (its name and model types must be new)."""
    assert spec.name not in _FAMILIES, f"family {spec.name} registered twice"
    taken = set(model_types())
    assert not taken & set(spec.model_types), f"model types {sorted(taken & set(spec.model_types))} registered twice"
    assert LANGUAGE not in spec.encoders, f"'{LANGUAGE}' is not a modality"
    _FAMILIES[spec.name] = spec
    return spec


def families() -> tuple[FamilySpec, ...]:
    """Every registered family, in registration order (the first is the default)."""
    return tuple(_FAMILIES.values())


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def model_types() -> tuple[str, ...]:
    """Every supported config.json ``model_type``, in registration order."""
    return tuple(mt for spec in _FAMILIES.values() for mt in spec.model_types)


def family_for_model_type(model_type) -> Optional[FamilySpec]:
    return next((spec for spec in _FAMILIES.values() if model_type in spec.model_types), None)


def default_family() -> FamilySpec:
    """The family assumed where no config.json says otherwise (the first registered)."""
    return next(iter(_FAMILIES.values()))


# ---- the families ------------------------------------------------------------------------------

def _qwen_vl_language_dims(config: dict) -> LanguageDims:
    """Qwen-VL config.json: the language sizes under ``text_config`` (at the top level in flat files)."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    return LanguageDims(heads=heads, kv_heads=text.get("num_key_value_heads", heads),
                        layers=text.get("num_hidden_layers"))


def routed_experts(text: dict):
    """``text_config``'s routed expert count: ``num_experts`` in released files, ``num_local_experts`` in the
    ones transformers 5.23 writes (its attribute map between the two names)."""
    return text.get("num_experts", text.get("num_local_experts"))


def sparse_layer_indexes(text: dict) -> frozenset:
    """Global indexes of a mixture-of-experts decoder's sparse layers, as transformers picks them
    (``Qwen3VLMoeTextDecoderLayer``): layer ``i`` unless listed in ``mlp_only_layers``, when ``(i + 1) %
    decoder_sparse_step == 0``; none without routed experts."""
    layers, experts = text.get("num_hidden_layers") or 0, routed_experts(text) or 0
    if not experts:
        return frozenset()
    step = max(int(text.get("decoder_sparse_step") or 1), 1)
    dense = set(text.get("mlp_only_layers") or ())
    return frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def with_expert_dims(dense_dims: Callable[[dict], LanguageDims]) -> Callable[[dict], LanguageDims]:
    """A mixture-of-experts family's ``language_dims``: its dense counterpart's sizes plus the routed experts
    and their FFN width (what ``expert_findings`` divides by ep and etp)."""

    def language_dims(config: dict) -> LanguageDims:
        text = config.get("text_config", config)
        return replace(dense_dims(config), experts=routed_experts(text), expert_ffn=text.get("moe_intermediate_size"))

    return language_dims


def _moe_findings(config: dict) -> Iterator[Finding]:
    """A router picks at least one and at most all experts."""
    text = config.get("text_config", config)
    e, k = routed_experts(text), text.get("num_experts_per_tok")
    if isinstance(e, int) and isinstance(k, int) and not 1 <= k <= e:
        yield (f"config.json text_config.num_experts_per_tok={k} must be between 1 and text_config.num_experts={e}; "
               f"fix the checkpoint's config.json")


#: ``text_config.layer_types`` entries of a hybrid decoder: a Gated DeltaNet layer, a gated full-attention layer
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


def _qwen3_5_language_dims(config: dict) -> LanguageDims:
    """Qwen3.5: the Qwen-VL sizes plus the Gated DeltaNet head counts (both sharded over tp)."""
    text = config.get("text_config", config)
    return replace(_qwen_vl_language_dims(config), gdn_key_heads=text.get("linear_num_key_heads"),
                   gdn_value_heads=text.get("linear_num_value_heads"))


def _hybrid_layer_findings(config: dict) -> Iterator[Finding]:
    """``text_config.layer_types`` names every layer's mixer, one known kind per layer (without it
    transformers derives the 3:1 pattern); the GDN value heads group evenly over its key heads."""
    text = config.get("text_config", config)
    types, layers = text.get("layer_types"), text.get("num_hidden_layers")
    if types is not None:
        wrong = []
        if not isinstance(types, list):
            wrong.append(f"it is a {type(types).__name__}, not a list")
        else:
            if isinstance(layers, int) and len(types) != layers:
                wrong.append(f"it lists {len(types)} entries for text_config.num_hidden_layers={layers}")
            unknown = [(i, t) for i, t in enumerate(types) if t not in HYBRID_LAYER_TYPES]
            if unknown:
                shown = ", ".join(f"{t!r} at layer {i}" for i, t in unknown[:3]) + (" ..." if len(unknown) > 3 else "")
                wrong.append(f"unknown entries {shown}")
        if wrong:
            yield (f"config.json text_config.layer_types: {'; '.join(wrong)}; list exactly one of "
                   f"{' or '.join(map(repr, HYBRID_LAYER_TYPES))} per layer (or drop layer_types for the 3:1 pattern)")
    k, v = text.get("linear_num_key_heads"), text.get("linear_num_value_heads")
    if isinstance(k, int) and isinstance(v, int) and k > 0 and v % k:
        yield (f"config.json text_config.linear_num_value_heads={v} is not a multiple of "
               f"text_config.linear_num_key_heads={k}; the Gated DeltaNet groups value heads evenly over key heads")


QWEN2_5_VL = register(FamilySpec(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    # transformers' vision tower runs as it is: no tp/pp/cp (tp on colocated layouts replicates it)
    encoders={IMAGES: EncoderLimits(tower="vision tower", implementation="Hugging Face Qwen-VL")},
    language_dims=_qwen_vl_language_dims,
    adapter="mimo_sft.model.qwen2_5_vl:Qwen25VLAdapter",
))

QWEN3_VL = register(FamilySpec(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    # transformers' Qwen3-VL vision tower (DeepStack mergers included) runs as it is, like Qwen2.5-VL's
    encoders={IMAGES: EncoderLimits(tower="vision tower", implementation="Hugging Face Qwen3-VL")},
    language_dims=_qwen_vl_language_dims,
    adapter="mimo_sft.model.qwen3_vl:Qwen3VLAdapter",
    rope_index="transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLModel",
    vision_flops="mimo_sft.model.vision_flops:qwen3_vl",
    architecture=Architecture(qkv_bias=False, qk_norm=True, vision_layer_norm=True, vision_gated_mlp=False,
                              vision_patch_bias=True, vision_pos_embed=True, deepstack=True),
    chat_template="qwen3_vl",
    video_timestamps=True,
    # full-layer recomputation is exact: model.deepstack hands the DeepStack rows' gradient past megatron's
    # re-entrant checkpoint and replays each micro-batch's rows into its recomputed layers
))

QWEN3_5 = register(FamilySpec(
    name="qwen3_5",
    model_types=("qwen3_5",),
    # transformers' Qwen3.5 vision tower (Qwen3-VL's without DeepStack) runs as it is
    encoders={IMAGES: EncoderLimits(tower="vision tower", implementation="Hugging Face Qwen3.5")},
    language_dims=_qwen3_5_language_dims,
    config_rules=(_hybrid_layer_findings,),
    adapter="mimo_sft.model.qwen3_5:Qwen35Adapter",
    rope_index="transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5Model",
    vision_flops="mimo_sft.model.vision_flops:qwen3_vl",
    architecture=Architecture(qkv_bias=False, qk_norm=True, vision_layer_norm=True, vision_gated_mlp=False,
                              vision_patch_bias=True, vision_pos_embed=True, deepstack=False, hybrid_gdn=True),
    # Qwen3.5's released template opens the last answer with a think block (data.processor)
    chat_template="qwen3_5",
    video_timestamps=True,
))

def moe_family(dense: FamilySpec, *, name: str, implementation: str, adapter: str, rope_index: str) -> FamilySpec:
    """``dense``'s descriptor with a mixture-of-experts decoder: the same tower (named ``implementation``),
    limits, template and rules, plus the experts in its dims (:func:`with_expert_dims`), the router's config
    rule and ``Architecture.moe``. ``name`` is also its one ``model_type``."""
    return replace(dense, name=name, model_types=(name,),
                   encoders={k: replace(v, implementation=implementation) for k, v in dense.encoders.items()},
                   language_dims=with_expert_dims(dense.language_dims),
                   config_rules=dense.config_rules + (_moe_findings,), adapter=adapter, rope_index=rope_index,
                   architecture=replace(dense.architecture, moe=True))


# Qwen3-VL's tower (DeepStack included) before a mixture-of-experts decoder
QWEN3_VL_MOE = register(moe_family(
    QWEN3_VL, name="qwen3_vl_moe", implementation="Hugging Face Qwen3-VL-MoE",
    adapter="mimo_sft.model.qwen3_vl_moe:Qwen3VLMoeAdapter",
    rope_index="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeModel"))

# Qwen3.5's tower before the hybrid decoder with sparse MLPs and a gated shared expert
QWEN3_5_MOE = register(moe_family(
    QWEN3_5, name="qwen3_5_moe", implementation="Hugging Face Qwen3.5-MoE",
    adapter="mimo_sft.model.qwen3_5_moe:Qwen35MoeAdapter",
    rope_index="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeModel"))

#: config.json ``model_type`` values of Qwen-VL generations mimo-sft knows of but cannot build yet, and why
NOT_YET_SUPPORTED: dict[str, str] = {}


def unsupported_model_type(model_type, where: str) -> str:
    """The one line that refuses a config.json ``model_type`` no family reads (``where`` names the file)."""
    supported = ", ".join(model_types())
    if model_type in NOT_YET_SUPPORTED:
        return (f"{where}: model_type {model_type!r} is {NOT_YET_SUPPORTED[model_type]}, not yet supported by "
                f"mimo-sft; supported model types: {supported}")
    return f"{where}: model_type {model_type!r} is not supported; supported model types: {supported}"


def family_mismatch(requested, model_type, where: str) -> Optional[str]:
    """The line refusing ``--model-family requested`` for a checkpoint of another family (None: they agree)."""
    spec = family_for_model_type(model_type)
    if spec is None or requested in (None, "auto") or requested == spec.name:
        return None
    return (f"--model-family {requested} does not match {where} (model_type {model_type!r} is family "
            f"{spec.name}); pass --model-family auto or {spec.name}")
