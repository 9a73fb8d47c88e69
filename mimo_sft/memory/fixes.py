"""The cheapest change that makes an over-budget layout fit, and check 23's message.

Changes are tried in order of what they cost the run (nothing, then a little compute, then more
compute, then a layout change), each on top of the previous ones, until the
forecast fits: the distributed optimizer (free: shards Adam's state over dp), sequence parallelism
(free with tp > 1), selective recomputation of the MLP (one MLP forward again), full recomputation
one layer at a time (one forward again), a doubled language tp, a doubled language cp; for the vision tower the
distributed optimizer, then ``--recompute-vision``. (A smaller ``--max-pixels`` is no fix: the worst case
fills every sample with image tokens whatever their size, ``memory.forecast.worst_case_workload``.)

Pure: re-runs ``memory.forecast`` on modified copies of the config.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from mimo_sft.memory.forecast import GIB, MemoryForecast, forecast_memory
from mimo_sft.parallel.layout import IMAGES, LANGUAGE, Layout


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _set(section: str, key: str, value):
    """A step that sets ``cfg.<section>.<key> = value`` and keeps the layout."""
    def apply(c, lay):
        setattr(getattr(c, section), key, value)
        return lay
    return apply


def _language_steps(cfg, layout, hf_config):
    from mimo_sft.config.families import default_family, family_for_model_type

    family = family_for_model_type(hf_config.get("model_type")) or default_family()
    m, lang = cfg.model, layout.spec(LANGUAGE)
    if not cfg.optimizer.use_distributed_optimizer and not m.lora_rank and lang.dp > 1:
        yield "--use-distributed-optimizer", _set("optimizer", "use_distributed_optimizer", True)
    if lang.tp > 1 and not m.sequence_parallel:
        yield "--sequence-parallel", _set("model", "sequence_parallel", True)
    if m.recompute_granularity is None:
        def selective(c, lay):
            c.model.recompute_granularity, c.model.recompute_modules = "selective", "core_attn,mlp"
            return lay
        yield "--recompute-granularity selective --recompute-modules core_attn,mlp", selective
    if m.recompute_granularity != "full" or (m.recompute_num_layers or 1) > 1 or m.recompute_method == "block":
        def full(c, lay):
            c.model.recompute_granularity, c.model.recompute_method, c.model.recompute_num_layers = "full", "uniform", 1
            return lay
        yield "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", full
    dims = family.language_dims(hf_config)
    tp2, tp, dp = lang.tp * 2, lang.tp, lang.dp
    if lang.dp % 2 == 0 and tp2 <= 8 and not (dims.heads or 0) % tp2 and not (dims.kv_heads or 0) % tp2:
        def raise_tp(c, lay):
            specs = [replace(s, tp=tp2, dp=s.dp // 2) if s.name == LANGUAGE else s for s in lay.components]
            return Layout.from_specs(specs, lay.world_size)
        yield f"language tp={tp2}, dp={lang.dp // 2}", raise_tp
        tp, dp = tp2, dp // 2
    cp2 = lang.cp * 2  # context parallelism: each cp rank holds half the positions (model.context_parallel)
    if dp % 2 == 0 and all(not n or (n // tp) % cp2 == 0 for n in (dims.heads, dims.gdn_key_heads,
                                                                   dims.gdn_value_heads)):
        def raise_cp(c, lay):
            specs = [replace(s, cp=cp2, dp=s.dp // 2) if s.name == LANGUAGE else s for s in lay.components]
            return Layout.from_specs(specs, lay.world_size)
        yield f"language cp={cp2}, dp={dp // 2}", raise_cp


def _vision_steps(cfg, layout):
    m = cfg.model
    if IMAGES not in layout.names:
        return
    if not cfg.optimizer.use_distributed_optimizer and not m.lora_rank and layout.spec(IMAGES).dp > 1:
        yield "--use-distributed-optimizer", _set("optimizer", "use_distributed_optimizer", True)
    if not m.recompute_vision:
        yield "--recompute-vision", _set("model", "recompute_vision", True)


def cheapest_fix(cfg, layout, hf_config: dict, group: str, budget: int, *, processor_max_pixels=None,
                 device: str = "cuda", counts=None) -> tuple[list[str], int] | None:
    """The shortest prefix of the ordered changes after which GPU group ``group`` (a module, or the
    colocated ``language+images``) fits ``budget`` bytes on ``device``: ``(changes, new peak)``, or None.
    ``counts``: the data's per-row counts, whose largest micro-batch is forecast on each changed layout."""
    steps = []
    if group in (LANGUAGE,) or "+" in group:
        steps += list(_language_steps(cfg, layout, hf_config))
    if group == IMAGES or "+" in group:
        steps += [s for s in _vision_steps(cfg, layout) if s[0] not in {n for n, _ in steps}]
    c, lay, done = copy.deepcopy(cfg), layout, []
    for name, apply in steps:
        lay = apply(c, lay)
        done.append(name)
        peak = forecast_memory(c, lay, hf_config, processor_max_pixels=processor_max_pixels,
                               device=device, counts=counts).gpu_peaks()[group]
        if peak <= budget:
            if any(d.startswith("--recompute-granularity full") for d in done):  # full recompute replaces selective
                done = [d for d in done if not d.startswith("--recompute-granularity selective")]
            return done, peak
    return None


def over_budget_messages(cfg, layout, hf_config: dict, forecast: MemoryForecast, budget: int, *,
                         processor_max_pixels=None, counts=None) -> list[str]:
    """One message per GPU group whose forecast exceeds ``budget`` bytes (check 23); ``counts``: the data's
    per-row counts the forecast was made from (None: the worst case, and the line says how to forecast the data)."""
    out = []
    for group, peak in forecast.gpu_peaks().items():
        if peak <= budget:
            continue
        names = group.split("+")
        terms: dict[str, int] = {}
        for n in names:
            for k, v in forecast.modules[n].terms.items():
                terms[k] = terms.get(k, 0) + v
        top = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])[:3])
        where = " and ".join(f"{n} ({forecast.modules[n].rank})" for n in names)
        fix = cheapest_fix(cfg, layout, hf_config, group, budget, processor_max_pixels=processor_max_pixels,
                           device=forecast.device, counts=counts)
        more = ("more GPUs for the tower (raise images dp), a smaller --micro-batch-size or --seq-length (the worst "
                "case fills every sample with image tokens)" if group == IMAGES and counts is None else
                "more GPUs for the tower (raise images dp) or a smaller --micro-batch-size" if group == IMAGES else
                "more GPUs (raise tp, cp or pp) or a smaller --micro-batch-size")
        advice = (f"cheapest fix: {' + '.join(fix[0])} (forecast {_gib(fix[1])})" if fix else
                  f"no flag alone makes it fit: use {more}")
        whose = ("this data's largest micro-batch" if counts is not None else
                 "the worst case; `mimo-sft check-data --write-costs` with these flags lets it forecast this data"
                 if forecast.workload.source.startswith("worst case") else "")
        out.append(f"{where}: forecast {_gib(peak)} per GPU exceeds --gpu-memory-gb {budget / GIB:g} "
                   f"(largest: {top}); {advice}" + (f" ({whose})" if whose else ""))
    return out
