"""LoRA settings as one value: the target names users may give, and the parsed, checked spec.

Pure (no torch, no megatron) so that ``config.checks`` can refuse bad LoRA flags before any process
starts, and the model side (``model.lora``) and export read the same names. What each target adapts:

==============  ==============================================================  ============
name            layers                                                          base frozen
==============  ==============================================================  ============
``linear_qkv``  each token mixer's fused input projection (column-parallel):     language
                attention q/k/v (``linear_qkv``); on a Gated DeltaNet layer
                (Qwen3.5) its ``in_proj``: q/k/v, output gate z, beta, alpha
``linear_proj`` each token mixer's output projection (row-parallel): attention  language
                ``linear_proj``; a Gated DeltaNet's ``out_proj``
``linear_fc1``  language MLP gate+up (fused, column-parallel)                   language
``linear_fc2``  language MLP down (row-parallel)                                language
``vision_attn`` vision tower ``blocks.N.attn.qkv`` / ``attn.proj``              vision tower
``vision_mlp``  vision tower ``blocks.N.mlp.{gate,up,down}_proj`` (Qwen2.5-VL),  vision tower
                ``blocks.N.mlp.linear_fc{1,2}`` (Qwen3-VL)
``merger``      patch merger ``merger.mlp.0`` / ``merger.mlp.2`` (Qwen2.5-VL);  projector
                ``merger.linear_fc{1,2}`` and every DeepStack merger's
                ``deepstack_merger_list.J.linear_fc{1,2}`` (Qwen3-VL)
==============  ==============================================================  ============

Which linears a vision target names is the family's (its encoder class's ``LORA_LAYERS``).

Why the two mixer targets cover the Gated DeltaNet too, not names of their own: a hybrid decoder's
layer has attention or a GDN in the same place, with one fused input and one output projection
either way, so the default (the four language targets) adapts every linear of every layer on every
family, as it always has; the default, meta.json's recorded targets and the resume check stay what
they were for the attention-only families. The price: attention and GDN layers cannot be chosen
apart (the same targets apply to both kinds).

With LoRA on, the language model's base weights are always frozen (adapters are the point); the
vision tower's and the projector's follow ``--freeze-vision`` / ``--freeze-projector`` unless one of
their targets is chosen, which freezes that part's base weights as well.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

LANGUAGE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
VISION_TARGETS = ("vision_attn", "vision_mlp")
PROJECTOR_TARGETS = ("merger",)
ALL_TARGETS = LANGUAGE_TARGETS + VISION_TARGETS + PROJECTOR_TARGETS
DEFAULT_TARGETS = ",".join(LANGUAGE_TARGETS)


def split_targets(text) -> list[str]:
    """``"a, b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (order kept, empties dropped)."""
    items = text if isinstance(text, (list, tuple)) else str(text or "").split(",")
    return [t.strip() for t in items if str(t).strip()]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def language(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if t in LANGUAGE_TARGETS)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        return cls(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]))

    @classmethod
    def from_model_config(cls, m) -> Optional["LoraSpec"]:
        """The spec of a checked ``config.schema.ModelConfig``; None when LoRA is off."""
        rank = int(getattr(m, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        alpha = m.lora_alpha if m.lora_alpha is not None else float(rank)
        return cls(rank, float(alpha), float(m.lora_dropout), tuple(split_targets(m.lora_target_modules)))


def distributed_optimizer_in_use(cfg) -> bool:
    """Whether a run of ``ExperimentConfig`` ``cfg`` shards its optimizer state over DP: the distributed
    optimizer (the default) except with LoRA, which uses the plain one (mimo-sft's choice: adapter
    optimizer state is small, and LoRA checkpoints hold only what trains; check 20 says so in a note)."""
    return bool(cfg.optimizer.use_distributed_optimizer) and int(cfg.model.lora_rank or 0) <= 0


def lora_problems(m) -> list[str]:
    """Every problem with the LoRA flags of ``ModelConfig`` ``m`` (one line each, naming the flag)."""
    out = []
    rank = m.lora_rank
    if rank < 0:
        out.append(f"--lora-rank={rank}: must be 0 (LoRA off) or a positive rank such as 8 or 16")
    if rank <= 0:
        if m.lora_alpha is not None:
            out.append(f"--lora-alpha={m.lora_alpha} is set but LoRA is off; give --lora-rank R (e.g. 16) or drop --lora-alpha")
        if m.lora_dropout:
            out.append(f"--lora-dropout={m.lora_dropout} is set but LoRA is off; give --lora-rank R or drop --lora-dropout")
        if split_targets(m.lora_target_modules) != split_targets(DEFAULT_TARGETS):
            out.append("--lora-target-modules is set but LoRA is off; give --lora-rank R or drop --lora-target-modules")
        return out
    if m.lora_alpha is not None and not m.lora_alpha > 0:
        out.append(f"--lora-alpha={m.lora_alpha}: must be positive (adapters are scaled by alpha / rank); e.g. {2 * rank}")
    if not 0.0 <= m.lora_dropout < 1.0:
        out.append(f"--lora-dropout={m.lora_dropout}: must be in [0, 1); e.g. 0.05")
    targets = split_targets(m.lora_target_modules)
    bad = [t for t in targets if t not in ALL_TARGETS]
    if bad:
        out.append(f"--lora-target-modules: unknown {', '.join(repr(t) for t in bad)}; choose from {', '.join(ALL_TARGETS)}")
    elif not targets:
        out.append(f"--lora-target-modules is empty; choose from {', '.join(ALL_TARGETS)}")
    elif len(set(targets)) != len(targets):
        out.append("--lora-target-modules names a layer twice; give each once")
    if getattr(m, "allow_random_init", False):
        out.append("--allow-random-init with --lora-rank: a LoRA checkpoint keeps only its adapters and reads the "
                   "base weights from --hf-model's safetensors again; drop --allow-random-init")
    return out


def describe_lora(d: dict) -> str:
    """A meta.json ``lora`` record as the flags that give it."""
    return f"--lora-rank {d['rank']} --lora-alpha {d['alpha']:g} --lora-target-modules {','.join(d['targets'])}"


def recorded_lora_problems(saved: Optional[dict], m, *, path: str, resume: bool) -> list[str]:
    """Why a run with ``ModelConfig`` ``m`` cannot load the checkpoint at ``path`` whose meta.json ``lora`` is
    ``saved`` (None: a full fine-tuning checkpoint), one line each. The loader takes the checkpoint's values for
    every key not given (``config.recorded``), so what differs here is a flag the user gave."""
    spec = LoraSpec.from_model_config(m)
    if saved and spec is None:
        return [f"--lora-rank {m.lora_rank} but the checkpoint {path} is a LoRA checkpoint ({describe_lora(saved)}): "
                f"drop --lora-rank to take its settings; to train without adapters from it, merge it first "
                f"(`mimo-sft export --checkpoint {path} --out DIR`) and give DIR as --hf-model"]
    if saved and spec is not None:
        mine = spec.to_dict()
        keys = (("rank", "--lora-rank"), ("alpha", "--lora-alpha"), ("targets", "--lora-target-modules"))
        differ = [(name, mine[k], saved[k]) for k, name in keys if saved[k] != mine[k]]
        out = [f"{name} {_shown(now)} differs from the checkpoint's {_shown(was)} ({path}): its adapters load only "
               f"with its LoRA settings; drop {name} to take the checkpoint's" for name, now, was in differ]
        if resume:
            for key in ("freeze_vision", "freeze_projector", "freeze_language"):
                if bool(saved.get(key)) != bool(getattr(m, key)):
                    flag = "--" + key.replace("_", "-")
                    out.append(f"{flag}={bool(getattr(m, key))} differs from the checkpoint's {flag}="
                               f"{bool(saved.get(key))} ({path}): resume with the same freeze flags (they decide what "
                               f"the checkpoint holds); drop {flag} to take the checkpoint's")
        return out
    if not saved and spec is not None and resume:
        return [f"--lora-rank {m.lora_rank} but the checkpoint {path} is a full fine-tuning checkpoint; resume it "
                f"without --lora-rank, or start LoRA from its weights with --pretrained-checkpoint"]
    return []


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)
