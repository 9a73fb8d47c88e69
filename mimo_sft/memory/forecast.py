"""GPU memory of each module's most loaded rank, forecast from config.json and the config alone.

Why: a layout that runs out of memory at step 1 costs a queue wait and a node-hour to find out;
``validate``, ``plan`` and ``finetune`` (check 23) forecast it before any process starts, and name
the cheapest change that makes it fit (``memory.fixes``). No weights are read, so a 72B layout is
forecast on a laptop.

Terms (bytes, per rank; docs/memory.md has every formula and what was measured):

* ``weights``: every parameter the rank holds, in ``--dtype`` (frozen ones too).
* ``gradients``: megatron DDP's grad buffer, fp32 (``train.setup`` sets ``grad_reduce_in_fp32``), one
  value per trainable parameter, also with the distributed optimizer (it reduce-scatters into it).
* ``optimizer``: Adam's two moments, plus fp32 main weights in bf16: 8 or 12 bytes per trainable
  parameter, divided by the module's dp x cp with the distributed optimizer (megatron shards it over
  ``dp_cp``). LoRA runs the plain optimizer.
* (every activation term is for one ``Workload``: the worst case, ``worst_case_workload``, or the largest
  micro-batch the data's rows can form, ``memory.from_data``, which also bounds the attention's padding)
* ``activations``: what autograd keeps (``memory.activations``, on the target ``device``: ``cuda`` by
  default, where torch's RMSNorm is one fused kernel; ``cpu`` for a run on the CPU) times the
  micro-batches the schedule holds: 1F1B (non-colocated) keeps ``stages - stage`` in flight, the encoder stage ``pp + 1``; a
  colocated step runs one at a time. ``recompute``: the one layer group (or block) rebuilt during
  backward. ``logits``: last stage's final norm and cross entropy.
* ``inputs`` (vision): pixel values and rotary tables. ``bridge``: the tensors crossing the
  encoder-language bridge and pipeline stages that the schedule keeps until their backward.
* ``allowance``: 2 GiB per GPU (CUDA context, cuBLAS workspace, NCCL buffers) plus 10 % of the
  activation terms (allocator fragmentation, backward temporaries). An assumption, not a measurement.

Pure: no torch, no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo_sft.config.lora import LoraSpec
from mimo_sft.memory import activations as act
from mimo_sft.memory.from_data import data_workload
from mimo_sft.memory.dims import (TextDims, VisionDims, language_params, language_stage_lora_params,
                                  language_stage_expert_params, language_stage_params,
                                  vision_module_params)
from mimo_sft.memory.workload import Workload
from mimo_sft.parallel.layout import IMAGES, LANGUAGE

GIB = 1024 ** 3
ALLOWANCE_FIXED = 2 * GIB
ALLOWANCE_SHARE = 0.10
#: Qwen2.5-VL's processor default (preprocessor_config.json ``max_pixels``) when nothing else says
DEFAULT_MAX_PIXELS = 28 * 28 * 16384
ACTIVATION_TERMS = ("activations", "recompute", "logits")


@dataclass
class ModuleForecast:
    module: str
    parameters: int       # the module's whole parameter count
    rank_parameters: int  # held by its most loaded rank
    rank: str             # which rank that is
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.terms.values())

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "parameters": self.parameters, "rank_parameters": self.rank_parameters,
                "rank": self.rank, "terms": dict(self.terms)}


@dataclass
class MemoryForecast:
    modules: dict[str, ModuleForecast]
    colocated: bool
    workload: Workload
    device: str = act.CUDA  # whose kernels the activation terms count

    def gpu_peaks(self) -> dict[str, int]:
        """Peak bytes per GPU group: each module's own ranks, or one sum when colocated."""
        if self.colocated:
            return {"+".join(self.modules): sum(m.peak_bytes for m in self.modules.values())}
        return {name: m.peak_bytes for name, m in self.modules.items()}

    def to_json(self) -> dict:
        return {name: m.to_json() for name, m in self.modules.items()}

    def report(self, budget_bytes: int, budget_source: str) -> dict:
        """The JSON-ready report the tables print and ``--json`` carries: modules, per-GPU peaks, budget."""
        return {"modules": self.to_json(), "gpu_peaks": self.gpu_peaks(), "budget_bytes": budget_bytes,
                "budget_source": budget_source, "workload": self.workload.source, "device": self.device}


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def _optimizer_bytes(trainable: int, *, b: int, distributed: bool, shards: int) -> int:
    per = 8 + (4 if b == 2 else 0)  # Adam moments (+ fp32 main weights for bf16 parameters)
    return per * (-(-trainable // shards) if distributed else trainable)


def _state_terms(held: int, trainable: int, *, b: int, distributed: bool, shards: int) -> dict[str, int]:
    return {"weights": held * b, "gradients": 4 * trainable,
            "optimizer": _optimizer_bytes(trainable, b=b, distributed=distributed, shards=shards)}


def max_pixels_of(cfg, processor_max_pixels: int | None) -> int:
    """--max-pixels, else the processor's max_pixels, else Qwen2.5-VL's default."""
    return int(cfg.data.max_pixels or processor_max_pixels or DEFAULT_MAX_PIXELS)


def worst_case_images(seq: int, tokens_per_image: int) -> str:
    """How ``seq`` image tokens split into images of at most ``tokens_per_image``: "3 images of 2,560 tokens
    and one of 512"."""
    full, rest = divmod(seq, tokens_per_image)
    if full == 0 or (full == 1 and not rest):
        return f"one image of {seq:,} tokens"
    head = f"{full} images" if full > 1 else "one image"
    head += f" of {tokens_per_image:,} tokens"
    return head + (f" and one of {rest:,}" if rest else "")


def worst_case_workload(cfg, layout, hf_config: dict, *, max_pixels: int) -> Workload:
    """Every sample padded to ``--seq-length``, every one of its tokens an image token: a sample may hold
    any number of images, each at most ``--max-pixels`` (a page of 2 Mpx is 2,560 tokens, so an 8k sample
    holds three and a part). What a vision rank keeps is linear in the patches of all of them (attention
    is per image or window, and keeps no score matrix: ``memory.activations``), so ``--max-pixels`` only
    sets how they split, not how many there are. Clips are covered by the same case: a clip's patch holds its
    ``temporal_patch_size`` frames and an image's patch the same number of (tiled) copies, so the tower's
    input and every activation per patch are the same, and a clip attends within one frame group at a time,
    which is at most an image's span when ``--video-max-pixels`` (per frame) is at most ``--max-pixels``."""
    v = VisionDims.from_config(hf_config)
    mbs, seq = cfg.train.micro_batch_size, cfg.data.seq_length
    lang = layout.spec(LANGUAGE)
    tokens_per_image = max(1, max_pixels // (v.patch * v.merge) ** 2)
    vis_dp = layout.spec(IMAGES).dp if IMAGES in layout.names else 1
    return Workload(language_tokens=max(1, mbs // lang.dp) * seq,
                    image_patches=max(1, mbs // vis_dp) * seq * v.merge ** 2,
                    image_tokens=max(1, mbs // lang.dp) * seq,
                    source=f"worst case: every sample {seq:,} tokens, all of them image tokens, as "
                           f"{worst_case_images(seq, tokens_per_image)} (--max-pixels {max_pixels:,})")


def _in_flight(layout, module: str, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak (megatron's 1F1B warmup + 1)."""
    if layout.colocated:
        return 1
    pp = layout.spec(LANGUAGE).pp
    return min(pp + 1 if module != LANGUAGE else pp - stage, num_microbatches)


def _stored_and_transient(m, full: list[float], kept: list[float], inp: float) -> tuple[float, float]:
    """What a stage keeps per token (``full``/``kept``: each layer's bytes without / with selective
    recomputation; ``inp``: a recomputed group's input) and the largest group rebuilt during backward.
    Uniform: groups of ``recompute_num_layers``, each keeping its input; block: the stage's first n
    layers recomputed one at a time, the rest kept."""
    layers = len(full)
    n = min(m.recompute_num_layers or 1, layers)
    if m.recompute_granularity == "full" and (m.recompute_method or "uniform") == "uniform":
        return -(-layers // n) * inp, max(sum(full[i:i + n]) for i in range(0, layers, n))
    if m.recompute_granularity == "full":  # block: the first n layers of the stage
        return n * inp + sum(kept[n:]), max(full[:n])
    return sum(kept), 0.0


def _language_stage(cfg, layout, d: TextDims, stage: int, wl: Workload, lora: LoraSpec | None,
                    device: str) -> dict[str, int]:
    m, lang = cfg.model, layout.spec(LANGUAGE)
    tp, pp, b = lang.tp, lang.pp, _bytes(m.dtype)
    sp = bool(m.sequence_parallel) and tp > 1
    experts = dict(ep=lang.ep, etp=lang.expert_tp)
    held = language_stage_params(d, tp=tp, pp=pp, stage=stage, **experts)
    adapters = language_stage_lora_params(d, lora, tp=tp, pp=pp, stage=stage) if lora else 0
    trainable = adapters if lora else (0 if m.freeze_language else held)
    distributed = cfg.optimizer.use_distributed_optimizer and not lora
    # a mixture-of-experts model's experts: the distributed optimizer shards them over the expert-dp ranks
    expert_held = language_stage_expert_params(d, tp=tp, pp=pp, stage=stage, **experts)
    expert_trains = expert_held if trainable == held else 0
    terms = _state_terms(held + adapters - expert_held, trainable - expert_trains, b=b, distributed=distributed,
                         shards=lang.dp * lang.cp)
    if expert_held:
        for key, value in _state_terms(expert_held, expert_trains, b=b, distributed=distributed,
                                       shards=max(lang.expert_dp, 1)).items():
            terms[key] += value
    tokens = -(-wl.language_tokens // lang.cp)  # context parallelism: each cp rank holds 1/cp of the positions
    modules = tuple(m.recompute_modules if isinstance(m.recompute_modules, (list, tuple))
                    else str(m.recompute_modules or "").split(","))
    selective = modules if m.recompute_granularity == "selective" else ()
    shape = dict(tp=tp, sp=sp, b=b, pp=pp, stage=stage, device=device, etp=lang.expert_tp)
    full = act.language_stage_layers(d, **shape)  # per token, each layer by its kind
    kept = act.language_stage_layers(d, **shape, recompute_modules=selective)
    if lora and m.lora_dropout > 0:
        kept = [k + act.lora_dropout_bytes(d, lora.language, tp=tp, b=b, layer_type=d.layer_type(i))
                for k, i in zip(kept, d.stage_layers(pp, stage))]
    # each layer's bytes for this workload: per token, and per padded attention slot beyond the tokens
    pads = max(0, (wl.language_slots or 0) - tokens) if cfg.data.in_batch_packing else 0
    kinds = [d.layer_type(i) for i in d.stage_layers(pp, stage)]
    full = [f * tokens + pads * act.language_slot_bytes(d, tp=tp, b=b, layer_type=k) for f, k in zip(full, kinds)]
    kept = [f * tokens + pads * act.language_slot_bytes(d, tp=tp, b=b, layer_type=k, recompute_modules=selective)
            for f, k in zip(kept, kinds)]
    inp = act.language_layer_input(d, tp=tp, sp=sp, b=b) * tokens
    stored, transient = _stored_and_transient(m, full, kept, inp)
    flight = _in_flight(layout, LANGUAGE, stage, _num_microbatches(cfg))
    terms["activations"] = int(flight * stored)
    terms["recompute"] = int(transient)
    head = act.language_head_terms(d, tp=tp, sp=sp, b=b, device=device)
    terms["logits"] = int(sum(head.values()) * tokens) if stage == pp - 1 else 0
    hidden_stream = tokens * d.hidden * b // (tp if sp else 1)
    bridge = (stage > 0) * flight * hidden_stream + (stage < pp - 1) * flight * hidden_stream
    if stage == 0 and IMAGES in layout.names:  # with DeepStack, k more features per image token
        bridge += (flight + 1) * wl.image_tokens * d.hidden * b * (1 + d.deepstack)
    terms["bridge"] = int(bridge)
    return terms


def _num_microbatches(cfg) -> int:
    return max(1, cfg.train.global_batch_size // max(1, cfg.train.micro_batch_size))


def _allowance(terms: dict[str, int], *, fixed: bool) -> int:
    share = ALLOWANCE_SHARE * sum(terms.get(k, 0) for k in ACTIVATION_TERMS + ("inputs",))
    return int((ALLOWANCE_FIXED if fixed else 0) + share)


def language_forecast(cfg, layout, hf_config: dict, wl: Workload, device: str = act.CUDA) -> ModuleForecast:
    d = TextDims.from_config(hf_config)
    lora = LoraSpec.from_model_config(cfg.model)
    pp = layout.spec(LANGUAGE).pp
    stages = [_language_stage(cfg, layout, d, s, wl, lora, device) for s in range(pp)]
    best = max(range(pp), key=lambda s: sum(stages[s].values()))
    terms = stages[best]
    terms["allowance"] = _allowance(terms, fixed=True)
    lang = layout.spec(LANGUAGE)
    tp = lang.tp
    held = language_stage_params(d, tp=tp, pp=pp, stage=best, ep=lang.ep, etp=lang.expert_tp)
    adapters = language_stage_lora_params(d, lora, tp=tp, pp=pp, stage=best) if lora else 0
    total = language_params(d) + (language_stage_lora_params(d, lora, tp=1, pp=1, stage=0) if lora else 0)
    return ModuleForecast(LANGUAGE, total, held + adapters, f"pp stage {best} of {pp}" if pp > 1 else "every rank",
                          terms)


def _vision_blocks(v: VisionDims, wl: Workload, *, b: int) -> list[tuple[int, float]]:
    """``(blocks, bytes each keeps)`` for the workload's patches: the per-patch terms, plus the attention's
    padding where the workload bounds it (windowed blocks over their windows, the others over whole images)."""
    patches = wl.image_patches
    block = sum(act.vision_block_terms(v, b=b).values()) * patches
    if wl.window_slots is None or wl.image_slots is None:
        return [(v.depth, block)]
    full = block + act.vision_padding_bytes(v, b=b, patches=patches, slots=wl.image_slots)
    windowed = block + act.vision_padding_bytes(v, b=b, patches=patches, slots=wl.window_slots)
    return [(v.full_attention_blocks, full), (v.depth - v.full_attention_blocks, windowed)]


def tower_share(patches: int, tp: int, unit_patches: int) -> float:
    """The fraction of a micro-batch's patches one of ``tp`` tower replicas encodes (``train.tower_split``: each
    takes contiguous units, an image or a clip's temporal patch, up to the nearest boundary of its share): at most
    ``patches / tp`` plus one unit of at most ``unit_patches``."""
    if tp <= 1 or patches <= 0:
        return 1.0
    return min(patches, -(-patches // tp) + max(unit_patches, 0)) / patches


def vision_forecast(cfg, layout, hf_config: dict, wl: Workload, *, unit_patches: int | None = None) -> ModuleForecast:
    """``unit_patches``: the largest image or clip temporal patch, in patches (None: a whole micro-batch's)."""
    m = cfg.model
    v = VisionDims.from_config(hf_config)
    lora = LoraSpec.from_model_config(m)
    spec = layout.spec(IMAGES)
    b = _bytes(m.dtype)
    params = vision_module_params(v, m, lora)
    distributed = cfg.optimizer.use_distributed_optimizer and not lora
    terms = _state_terms(params.rank, params.rank_trainable, b=b, distributed=distributed, shards=spec.dp * spec.cp)
    targets = set(lora.targets) if lora else set()
    tower_trains = (not m.freeze_vision) or bool(targets & {"vision_attn", "vision_mlp"})
    merger_trains = tower_trains or not m.freeze_projector or "merger" in targets
    patches = wl.image_patches
    flight = _in_flight(layout, IMAGES, 0, _num_microbatches(cfg))
    blocks = _vision_blocks(v, wl, b=b)
    if not tower_trains:
        stored, transient = 0, 0
    elif m.recompute_vision:
        stored, transient = v.depth * act.vision_block_input(v, b=b) * patches, max(one for n, one in blocks if n)
    else:
        stored, transient = sum(n * one for n, one in blocks), 0
    if merger_trains:
        stored += act.merger_terms(v, b=b) * patches
    share = tower_share(patches, spec.tp, patches if unit_patches is None else unit_patches)
    stored, transient = stored * share, transient * share  # a replica keeps its share's activations only
    terms["inputs"] = int(flight * act.vision_input_terms(v, b=b, tower_trains=tower_trains) * patches)
    terms["activations"] = int(flight * stored)
    terms["recompute"] = int(transient)
    image_tokens = patches // v.merge ** 2
    terms["bridge"] = int((flight + 1) * image_tokens * v.out_hidden * (1 + v.deepstack) * b)
    terms["allowance"] = _allowance(terms, fixed=not layout.colocated)
    return ModuleForecast(IMAGES, params.total, params.rank, "every rank", terms)


def forecast_memory(cfg, layout, hf_config: dict, *, workload: Workload | None = None, counts=None,
                    processor_max_pixels: int | None = None, device: str = act.CUDA) -> MemoryForecast:
    """The forecast of every module in ``layout`` (a checked ``parallel.layout.Layout``) for ``cfg``
    (an ``ExperimentConfig``) and a Qwen-VL config.json dict, on ``device``'s kernels (``act.DEVICES``;
    the vision tower keeps the same on both): for ``workload``, else the largest micro-batch the data's
    per-row ``counts`` (``memory.from_data.RowCounts``) can form on this layout, else the worst case."""
    if workload is None and counts is not None:
        workload = data_workload(cfg, layout, hf_config, counts)
    wl = workload or worst_case_workload(cfg, layout, hf_config,
                                         max_pixels=max_pixels_of(cfg, processor_max_pixels))
    modules = {LANGUAGE: language_forecast(cfg, layout, hf_config, wl, device)}
    if IMAGES in layout.names:
        unit = wl.unit_patches
        if unit is None:  # an image at most --max-pixels, a clip's temporal patch at most --video-max-pixels
            pixels = max(max_pixels_of(cfg, processor_max_pixels), cfg.data.video_max_pixels or 0)
            unit = -(-pixels // VisionDims.from_config(hf_config).patch ** 2)
        modules[IMAGES] = vision_forecast(cfg, layout, hf_config, wl, unit_patches=unit)
    return MemoryForecast(modules, layout.colocated, wl, device)
