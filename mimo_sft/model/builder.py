"""Assemble megatron-core's ``MimoModel`` for this rank's modules from a local HF checkpoint folder.

``build_mimo_model`` is collective: every rank of the layout calls it (MimoModel builds its bridge
communicators on all ranks). Each rank builds only the modules it runs (``MimoModel`` reads the
grids from ``parallel_state.grids``) and reads only its own slices of the safetensors shards.

The layout limits (the family's, from its descriptor in ``config.families``, and megatron's
colocated pp = 1) are only asserted here: ``check_config``, which finetune runs first, refuses
them with a message, and export and check-model build a fixed 1-rank layout within them.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from mimo_sft.config.families import layout_problems
from mimo_sft.errors import UserError
from mimo_sft.model.family import ModelInfo
from mimo_sft.model.hf_checkpoint import HFCheckpoint, read_config_json
from mimo_sft.model.recompute import enable_vision_recompute, language_memory_settings, require_decoder_input_grad
from mimo_sft.model.registry import get_family
from mimo_sft.model.vision_attention import SEGMENT_ATTENTION, SegmentAttentionTower
from mimo_sft.parallel import runtime
from mimo_sft.parallel.layout import IMAGES, LANGUAGE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_MAX_SEQ_LEN = 32768
#: transformers' vision attention for each ``--attention-backend``: one SDPA call per block
#: (``model.vision_attention``), or transformers' eager attention beside megatron's local core
VISION_ATTENTION = {"sdpa": SEGMENT_ATTENTION, "local": "eager"}  # by model.attention.core_backend


def _check_layout(layout, hf_cfg, adapter, hf_dir: str) -> None:
    """Assert the layout is one ``check_config`` accepts for this checkpoint (an internal error otherwise).

    The family's rules are the descriptor's (checks 3, 4, 10, 12, 16 word them for the user), read
    on the transformers config (config.json with its defaults); colocated modules need pp = 1
    (check 11, megatron's ColocatedBridgeCommunicator; language cp > 1 crosses it folded into tp:
    ``model.context_parallel``).
    """
    problems = layout_problems(adapter.spec, layout, hf_cfg.to_dict())
    assert not problems, f"{hf_dir}: layout {layout.names} passed to build_mimo_model unchecked: {'; '.join(problems)}"
    assert not layout.colocated or all(s.pp == 1 for s in layout.components), (
        f"colocated layout with pp > 1 passed to build_mimo_model unchecked: {layout.components}")


def _freeze(model, adapter, model_cfg) -> None:
    if model_cfg is None:
        return
    if model_cfg.freeze_language and model.language_model is not None:
        for p in model.language_model.parameters():
            p.requires_grad_(False)
    for enc in _encoders(model):
        for name, p in enc.named_parameters():
            projector = adapter.projector_param(name)
            if (projector and model_cfg.freeze_projector) or (not projector and model_cfg.freeze_vision):
                p.requires_grad_(False)


def build_mimo_model(hf_dir: str, *, layout, parallel_state, model_cfg=None, random_init: Optional[bool] = None,
                     config_overrides: Optional[dict] = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                     attention: Optional[str] = None, cpu_init: Optional[bool] = None):
    """Build ``MimoModel`` (this rank's modules) with weights from ``hf_dir``; returns ``(model, ModelInfo)``.

    ``model_cfg`` is a ``config.schema.ModelConfig`` (family, dtype, freeze flags, allow_random_init,
    recompute and sequence-parallel settings: ``model.recompute``); ``random_init`` overrides
    ``model_cfg.allow_random_init``. ``config_overrides`` is applied to the language
    ``TransformerConfig`` (and the encoder's DDP config), e.g. ``calculate_per_token_loss``.
    ``attention``: ``"auto"``, ``"sdpa"`` or ``"varlen"`` (``model.attention.SDPAttention`` for the language model, one call per
    vision block: ``model.vision_attention``) or ``"local"`` (megatron's local core, transformers' eager vision
    attention); default ``model_cfg.attention_backend``, else ``"auto"``. ``cpu_init``: create the
    parameters in host memory (default: when the process's device is the CPU; export asks for it on
    GPU machines too). ``runtime.init_megatron`` must have run.
    """
    from mimo_sft.parallel.megatron_patches import swiglu_uncompiled

    swiglu_uncompiled()  # no compile in step 1, none per packed length (parallel.megatron_patches)
    if cpu_init is None:
        cpu_init = runtime.device().type == "cpu"
    from mimo_sft.model.attention import core_backend
    from mimo_sft.model.segments import use_kernel

    backend = attention or getattr(model_cfg, "attention_backend", None) or "auto"
    attention = core_backend(backend)
    if attention == "sdpa":  # the segment kernel: torch's variable-length one where allowed (model.segments)
        use_kernel(backend)
    if backend == "varlen":
        from mimo_sft.model.segments import varlen_function

        if runtime.device().type != "cuda" or varlen_function() is None:
            raise UserError(f"--attention-backend varlen needs a CUDA GPU and a torch with torch.nn.attention.varlen "
                            f"(this process: {runtime.device().type}, torch {torch.__version__}); use "
                            f"--attention-backend auto, which picks it where it runs")
    if random_init is None:
        random_init = bool(getattr(model_cfg, "allow_random_init", False))
    src = _BuildInputs.read(hf_dir, layout, model_cfg, random_init=random_init)
    overrides = dict(config_overrides or {})
    lang = layout.spec(LANGUAGE)
    info: ModelInfo = src.adapter.info(src.hf_cfg, tp=lang.tp)
    info.hf_dir = hf_dir
    info.prefix_style = src.ckpt.prefix_style if src.ckpt is not None else "legacy"
    info.modules_on_rank = parallel_state.mine()
    lang_overrides = {**overrides, **language_memory_settings(model_cfg, tp=lang.tp)}
    if lang.cp > 1:  # Ulysses around the SDPA core (model.context_parallel)
        lang_overrides.update(context_parallel_size=lang.cp, cp_comm_type="a2a")
    if src.adapter.spec.architecture.moe:
        lang_overrides.update(_expert_settings(lang, model_cfg))
    info.language_config = src.adapter.language_transformer_config(
        src.hf_cfg, tp=lang.tp, pp=lang.pp, dtype=src.dtype, random_init=random_init, cpu_init=cpu_init,
        overrides=lang_overrides)
    modality_specs = {}
    if IMAGES in layout.names:
        info.vision_config = src.adapter.vision_transformer_config(src.hf_cfg, dtype=src.dtype, cpu_init=cpu_init,
                                                                 overrides=overrides)
        # where megatron puts its own parameters: the process's device, or with cpu_init the default device (the
        # host; export's meta_model builds under a meta context)
        tower_device = torch.get_default_device() if cpu_init else runtime.device()
        modality_specs[IMAGES] = _vision_spec(src, parallel_state, attention, tower_device)
    model = _assemble(src, info, parallel_state, modality_specs, attention=attention, max_seq_len=max_seq_len)
    _load_weights(model, src, info, parallel_state, hf_dir)
    _freeze(model, src.adapter, model_cfg)
    _enable_recompute(model, info, model_cfg)
    return model, info


@dataclass
class _BuildInputs:
    """What ``build_mimo_model`` reads before building: the family adapter, the transformers config,
    the dtype and (unless random init) the checkpoint, whose tensor shapes are checked here."""

    adapter: object
    hf_cfg: object
    dtype: torch.dtype
    ckpt: Optional[HFCheckpoint]

    @classmethod
    def read(cls, hf_dir: str, layout, model_cfg, *, random_init: bool) -> "_BuildInputs":
        raw = read_config_json(hf_dir)
        adapter = get_family(raw, hf_dir=hf_dir, requested=getattr(model_cfg, "family", "auto"))
        hf_cfg = adapter.load_hf_config(hf_dir, raw)
        _check_layout(layout, hf_cfg, adapter, hf_dir)
        ckpt = None
        if not random_init:
            ckpt = HFCheckpoint(hf_dir)
            adapter.check_weights(ckpt, hf_cfg)
        return cls(adapter, hf_cfg, DTYPES[getattr(model_cfg, "dtype", "fp32") or "fp32"], ckpt)


def _expert_settings(lang, model_cfg) -> dict:
    """A mixture-of-experts language model's layout: ep and etp. megatron's own load-balancing loss stays
    off: ``--moe-aux-loss-coeff`` is ``train.expert_load``'s (megatron scales its gradient for a loss averaged
    over every token position, not over supervised tokens as mimo-sft's)."""
    return dict(expert_model_parallel_size=lang.ep, expert_tensor_parallel_size=lang.expert_tp,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _expert_slice(groups):
    """This rank's experts: its ep and expert-tp ranks (``model.moe_weights.ExpertSlice``)."""
    from mimo_sft.model.moe_weights import ExpertSlice

    pgc = groups.pg_collection
    return ExpertSlice(ep_rank=pgc.ep.rank(), ep=pgc.ep.size(), etp_rank=pgc.expt_tp.rank(), etp=pgc.expt_tp.size(),
                       tp_rank=pgc.tp.rank(), tp=pgc.tp.size())


def _language_stage(info, parallel_state) -> tuple[int, bool, bool]:
    """This rank's language pipeline stage: ``(pp_rank, pre_process, post_process)``."""
    groups = parallel_state.modules[LANGUAGE]
    pp_rank = groups.pg_collection.pp.rank() if groups.member else 0
    return pp_rank, pp_rank == 0, pp_rank == info.language_config.pipeline_model_parallel_size - 1


def _vision_spec(src: _BuildInputs, parallel_state, attention: str, device: torch.device):
    """The images module's spec: the family's tower, built on ``device`` (``model.tower_build``: parameters
    for the checkpoint to fill, or initialised there with random init)."""
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mimo_sft.model.tower_build import built_on

    encoder_class = src.adapter.encoder_class()
    implementation = VISION_ATTENTION[attention]
    assert implementation != SEGMENT_ATTENTION or issubclass(encoder_class, SegmentAttentionTower), (
        f"{encoder_class.__name__} must mix in model.vision_attention.SegmentAttentionTower to run "
        f"{SEGMENT_ATTENTION!r} (transformers would look for a flash-attn kernel by that name)")
    enc_spec = ModuleSpec(module=built_on(encoder_class, device, from_checkpoint=src.ckpt is not None),
                          params=src.adapter.encoder_params(src.hf_cfg, attn_implementation=implementation))
    return ModuleSpec(module=VisionModalitySubmodules,
                      params={"pg_collection": parallel_state.modules[IMAGES].pg_collection},
                      submodules={"encoders": {src.adapter.encoder_name: enc_spec}})


def _assemble(src: _BuildInputs, info, parallel_state, modality_specs: dict, *, attention: str, max_seq_len: int):
    """``MimoModel`` from the language ``GPTModel`` spec and the modality specs (collective); the family's
    adapter names both classes (megatron's own, or its subclasses where the family needs more)."""
    from megatron.core.models.mimo import MimoModelConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    lang_cfg = info.language_config
    pp_rank, pre, post = _language_stage(info, parallel_state)
    lang_groups = parallel_state.modules[LANGUAGE]
    layer_spec = src.adapter.block_spec(src.hf_cfg, get_num_layers_to_build(lang_cfg, pp_rank=pp_rank), attention=attention,
                                        layer_offset=get_transformer_layer_offset(lang_cfg, None, pp_rank))
    lm_params = dict(config=lang_cfg, transformer_layer_spec=layer_spec, pre_process=pre, post_process=post,
                     pg_collection=lang_groups.pg_collection,
                     **src.adapter.language_model_params(src.hf_cfg, padded_vocab=info.padded_vocab_size,
                                                       max_seq_len=max_seq_len))
    language_class = src.adapter.language_model_class(src.hf_cfg)
    mimo_cfg = MimoModelConfig(language_model_spec=ModuleSpec(module=language_class, params=lm_params),
                               modality_submodules_spec=modality_specs, special_token_ids=dict(info.special_token_ids),
                               module_to_grid_map=parallel_state.grids)
    # the TP group of megatron's MIMO sequence-parallel scatter (PartitionAdapter); megatron's global
    # groups are never initialised here
    groups = {"tp_group": lang_groups.pg_collection.tp, "cp_group": lang_groups.pg_collection.cp} if lang_groups.member else {}
    with _built_in(src.dtype, skip_init=src.ckpt is not None):
        return src.adapter.mimo_model_class(src.hf_cfg)(mimo_cfg, **groups)


@contextmanager
def _built_in(dtype: torch.dtype, *, skip_init: bool):
    """Modules made while MimoModel builds get their parameters in ``dtype`` (torch's default dtype
    for the duration: megatron passes its ``params_dtype`` itself, transformers' vision tower takes
    the default), and with ``skip_init`` (every weight comes from the checkpoint; ``copy_into``
    asserts it) transformers' and torch's initialisers do nothing.

    Why: the tower is then allocated once, in its training dtype, and its pages are first written
    by the weight copy -- not built in fp32, initialised, and cast into a second copy. Buffers made
    with an explicit dtype (rotary ``inv_freq``, fp32) keep it.
    """
    from transformers.initialization import no_init_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights() if skip_init else nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous)


def _load_weights(model, src: _BuildInputs, info, parallel_state, hf_dir: str) -> None:
    """Cast to the dtype and copy this rank's slices of the checkpoint in (nothing with random init)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mimo_sft.model.decoder_weights import copy_into
    from mimo_sft.model.hf_checkpoint import one_group_mapped

    if model.language_model is not None:
        model.language_model.to(src.dtype)
        if src.ckpt is not None:
            pp_rank, pre, post = _language_stage(info, parallel_state)
            lang_groups = parallel_state.modules[LANGUAGE]
            tensors = src.adapter.load_language(
                src.ckpt, src.hf_cfg, tp_rank=lang_groups.pg_collection.tp.rank(), tp=lang_groups.pg_collection.tp.size(),
                layer_offset=get_transformer_layer_offset(info.language_config, None, pp_rank),
                num_local_layers=len(model.language_model.decoder.layers), pre_process=pre, post_process=post,
                padded_vocab=info.padded_vocab_size, experts=_expert_slice(lang_groups))
            copy_into(model.language_model, one_group_mapped(src.ckpt, tensors), where=f"{hf_dir} language")
    from mimo_sft.model.pixels import pixel_norm_from

    for enc in _encoders(model):
        _cast_keeping_fp32_buffers(enc, src.dtype)
        enc.pixel_norm = pixel_norm_from(hf_dir)  # uint8 patches are normalised on the device
        if src.ckpt is not None:
            weights = src.adapter.load_encoder(src.ckpt, src.hf_cfg)
            copy_into(enc, one_group_mapped(src.ckpt, [weights] if isinstance(weights, dict) else weights),
                      where=f"{hf_dir} vision")


def set_pixel_norm(model, norm) -> None:
    """Every encoder of ``model`` normalises uint8 patches with ``norm`` (``model.pixels``): the run's image
    backend decides the images' arithmetic (``train.setup``)."""
    for enc in _encoders(model):
        enc.pixel_norm = norm


def _encoders(model) -> list:
    if IMAGES not in model.modality_submodules:
        return []
    return list(model.modality_submodules[IMAGES].encoders.values())


def _enable_recompute(model, info, model_cfg) -> None:
    """``--recompute-vision`` on the tower; under language recomputation the decoder's input requires
    grad (``model.recompute``: megatron's re-entrant checkpoint needs it)."""
    if model.language_model is not None and info.language_config.recompute_granularity:
        require_decoder_input_grad(model.language_model)
    if getattr(model_cfg, "recompute_vision", False):
        for enc in _encoders(model):
            enable_vision_recompute(enc)


def _cast_keeping_fp32_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` except floating buffers, which keep their (fp32) values.

    The only floating buffers of the vision tower are rotary frequencies (``inv_freq``): computed in
    fp32 they cost nothing, rounded to bf16 they put a 0.35 % error into every position.
    """
    kept = {name: buf for name, buf in module.named_buffers() if buf.is_floating_point()}
    module.to(dtype)
    for name, buf in kept.items():
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        setattr(owner, name.rpartition(".")[2], buf)


# ---- single process (export, check-model, tests) --------------------------------------------------
def build_single_process_model(hf_dir: str, *, random_init: bool = False, model_cfg=None,
                               config_overrides: Optional[dict] = None, attention: Optional[str] = None,
                               prefer: str = "auto", cpu_init: Optional[bool] = None):
    """``build_mimo_model`` on a 1-rank colocated layout (TP=1, both modules); for export and checks.

    The parameters live on this process's device unless ``cpu_init`` (export builds in host memory).
    The 1-rank world, its groups and megatron's state come from ``parallel.bootstrap``.
    """
    from mimo_sft.parallel.bootstrap import start_single_process

    state = start_single_process(prefer)
    return build_mimo_model(hf_dir, layout=state.layout, parallel_state=state, model_cfg=model_cfg,
                            random_init=random_init, config_overrides=config_overrides,
                            attention=attention, cpu_init=cpu_init)
