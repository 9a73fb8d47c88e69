"""What a checkpoint records and a run starting from it takes unless a flag gives it (issue 55 items 4 and 5):
its LoRA settings (resume, evaluate), its freeze flags (resume), its LR schedule (resume); an explicit flag that
differs is refused before launch; ``--load-checkpoint auto`` without ``--save``; ``evaluate`` on one process.

In process: the checkpoints here are folders whose meta.json is what a save writes for a run's config (the
writers themselves: ``lora_meta``, ``schedule_meta``); no tensor is read before launch. The runs that load them
are in tests/test_lora_e2e.py (a LoRA resume without its flags) and tests/test_moe_e2e.py (a resume with
another --train-iters).
"""

from __future__ import annotations

import json
import math

import pytest

from mimo_sft.config.loader import load_config
from mimo_sft.config.recorded import lr_decay_length, schedule_meta
from mimo_sft.train.lr import lr_at
from mimo_sft.validate import check_config

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv,linear_proj"]


def _checkpoint(root, flags: list[str], step: int = 2) -> str:
    """A checkpoint folder (``root/checkpoints``, its ``latest`` naming step ``step``) of a run given ``flags``."""
    from mimo_sft.train.checkpoint.lora import lora_meta

    cfg = load_config(flags)
    folder = root / "checkpoints" / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step, **lora_meta(cfg.model), **schedule_meta(cfg)}))
    (root / "checkpoints" / "latest").write_text(folder.name)
    return str(root / "checkpoints")


def _problems(args: list[str], check: int) -> list[str]:
    return [p.message for p in check_config(load_config(args)).problems if p.check == check]


def test_the_loader_knows_which_keys_were_given(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  lora_rank: 4\ntrain:\n  seed: 3\n")
    cfg = load_config(["--config", str(yaml), "--train-iters", "7", "--component", "language=dp=1",
                       "--no-drop-last"])
    assert cfg.given == {("model", "lora_rank"), ("train", "seed"), ("train", "train_iters"),
                         ("parallel", "components"), ("data", "drop_last")}
    assert load_config([]).given == frozenset()
    from mimo_sft.config.loader import config_to_dict

    assert set(config_to_dict(cfg)) == {"model", "data", "parallel", "reorder", "train", "optimizer", "checkpoint",
                                        "logging"}


def test_a_lora_resume_takes_the_checkpoints_settings_and_refuses_only_a_real_conflict(tmp_path):
    ck = _checkpoint(tmp_path, [*LORA, "--lora-dropout", "0.1", "--freeze-vision"])
    cfg = load_config(["--load-checkpoint", ck])
    m = cfg.model
    assert (m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules, m.freeze_vision) == (
        4, 8.0, 0.1, "linear_qkv,linear_proj", True)
    assert cfg.checkpoint.recorded.startswith("LoRA settings from the checkpoint: --lora-rank 4 --lora-alpha 8 "
                                              "--lora-dropout 0.1 --lora-target-modules linear_qkv,linear_proj "
                                              "--freeze-vision; ")
    result = check_config(cfg)
    assert not [p for p in result.problems if p.check == 20]
    assert any(n.check == 15 and n.message == cfg.checkpoint.recorded for n in result.notes)  # validate says it
    # the same values given: no conflict; one given, the others still taken
    assert not _problems(["--load-checkpoint", ck, *LORA, "--freeze-vision"], 20)
    assert load_config(["--load-checkpoint", ck, "--lora-rank", "4"]).model.lora_alpha == 8.0
    # an explicit flag (or YAML key) that differs: refused before launch, naming it
    (line,) = _problems(["--load-checkpoint", ck, "--lora-alpha", "16"], 20)
    assert line == (f"--lora-alpha 16 differs from the checkpoint's 8 ({ck}): its adapters load only with its LoRA "
                    f"settings; drop --lora-alpha to take the checkpoint's")
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  lora_target_modules: [linear_qkv]\n")
    assert _problems(["--config", str(yaml), "--load-checkpoint", ck], 20)[0].startswith(
        "--lora-target-modules linear_qkv differs from the checkpoint's linear_qkv,linear_proj")
    assert _problems(["--load-checkpoint", ck, "--no-freeze-vision"], 20)[0].startswith(
        "--freeze-vision=False differs from the checkpoint's --freeze-vision=True")
    (off,) = _problems(["--load-checkpoint", ck, "--lora-rank", "0"], 20)
    assert off.startswith(f"--lora-rank 0 but the checkpoint {ck} is a LoRA checkpoint") and "fine-tune" not in off
    # a dropout given wins (it changes no stored tensor); a full fine-tuning checkpoint takes nothing
    assert load_config(["--load-checkpoint", ck, "--lora-dropout", "0"]).model.lora_dropout == 0.0
    full = _checkpoint(tmp_path / "full", [])
    assert load_config(["--load-checkpoint", full]).model.lora_rank == 0
    assert _problems(["--load-checkpoint", full, "--lora-rank", "4"], 20)[0].startswith(
        f"--lora-rank 4 but the checkpoint {full} is a full fine-tuning checkpoint")
    assert not _problems(["--pretrained-checkpoint", full, "--lora-rank", "4"], 20)  # LoRA from its weights


def test_evaluate_takes_the_lora_settings_and_one_process(tmp_path):
    from mimo_sft.train.evaluate import _taken_line, evaluate_args

    ck = _checkpoint(tmp_path, [*LORA, "--freeze-vision"])
    args, layout = evaluate_args([ck, "--json"], 1)
    assert layout == ["language=dp=1", "images=dp=1"] and "--json" not in args
    cfg = load_config(args)
    assert cfg.model.pretrained_checkpoint == ck and cfg.model.lora_rank == 4 and not cfg.model.freeze_vision
    result = check_config(cfg, world_size=1, for_run=True)
    assert not [p for p in result.problems if p.check in (2, 20)], result.problems
    assert result.layout.world_size == 1
    assert _taken_line(cfg, layout) == ("LoRA settings from the checkpoint: --lora-rank 4 --lora-alpha 8 --lora-dropout 0 "
                                        "--lora-target-modules linear_qkv,linear_proj; one process (language=dp=1 "
                                        "images=dp=1; no --component given)")
    assert evaluate_args([ck, "--component", "language=dp=2", "--component", "images=dp=2"], 2)[1] == []
    assert evaluate_args([ck], 2)[1] == ["language=dp=2", "images=dp=2"]  # --nproc-per-node 2 without a layout


def test_a_resume_with_more_steps_continues_the_checkpoints_schedule(tmp_path):
    """The first run: 4 steps of cosine with 1 warm-up step. Resumed with --train-iters 8, steps 3-4 get the first
    run's learning rates and steps 5-8 --min-lr; --lr-decay-iters 8 re-stretches it over the 8 steps."""
    first = ["--train-iters", "4", "--lr-warmup-iters", "1", "--lr", "1e-3", "--min-lr", "1e-5"]
    ck = _checkpoint(tmp_path, first)

    def lrs(cfg, steps):
        o = cfg.optimizer
        return [lr_at(s, lr=o.lr, min_lr=o.min_lr, warmup=o.lr_warmup_iters, total=lr_decay_length(cfg),
                      style=o.lr_decay_style) for s in steps]

    ran = lrs(load_config(first), range(4))
    resumed = load_config(["--load-checkpoint", ck, "--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-5"])
    assert (resumed.optimizer.lr_decay_iters, resumed.optimizer.lr_warmup_iters) == (4, 1)
    assert lrs(resumed, range(2, 8)) == ran[2:] + [1e-5] * 4
    assert resumed.checkpoint.recorded == ("LR schedule from the checkpoint: warm-up 1, decay over 4 steps; steps 5-8 "
                                           "stay at --min-lr 1e-05 (--lr-decay-iters 8 re-stretches it)")
    stretched = load_config(["--load-checkpoint", ck, "--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-5",
                             "--lr-decay-iters", "8"])
    assert lrs(stretched, range(8)) == lrs(load_config(["--train-iters", "8", "--lr-warmup-iters", "1", "--lr", "1e-3",
                                                        "--min-lr", "1e-5"]), range(8))
    assert lrs(stretched, [2])[0] > ran[2] and not math.isclose(lrs(stretched, [7])[0], 1e-5)
    assert stretched.checkpoint.recorded == ("LR schedule re-stretched by --lr-decay-iters 8 (warm-up 1; the "
                                             "checkpoint's decayed over 4 steps)")
    # the same --train-iters: the same schedule, said as the checkpoint's; a warm-up given wins
    assert load_config(["--load-checkpoint", ck, "--train-iters", "4"]).checkpoint.recorded == (
        "LR schedule from the checkpoint: warm-up 1, decay over 4 steps")
    assert load_config(["--load-checkpoint", ck, "--lr-warmup-iters", "0"]).optimizer.lr_warmup_iters == 0
    # from its weights (--pretrained-checkpoint) a run starts its own schedule
    assert load_config(["--pretrained-checkpoint", ck, "--train-iters", "8"]).optimizer.lr_decay_iters is None
    assert any(p.startswith("--lr-decay-iters=0 must be >= 1") for p in _problems(["--lr-decay-iters", "0"], 1))


def test_load_checkpoint_auto_looks_in_the_default_checkpoint_folder(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(["--load-checkpoint", "auto", "--output-dir", str(out)])
    assert cfg.checkpoint.resume_auto and cfg.checkpoint.load_checkpoint is None  # nothing yet: a fresh start
    assert not _problems(["--load-checkpoint", "auto", "--output-dir", str(out)], 15)
    ck = _checkpoint(out, [])
    assert ck == str(out / "checkpoints")
    assert load_config(["--load-checkpoint", "auto", "--output-dir", str(out)]).checkpoint.load_checkpoint == ck


@pytest.mark.parametrize("flags", [[], LORA])
def test_a_checkpoint_without_a_schedule_record_says_so(tmp_path, flags):
    """A checkpoint of an older mimo-sft (no ``lr_schedule``): the run decays over its own --train-iters."""
    ck = _checkpoint(tmp_path, flags)
    meta_path = tmp_path / "checkpoints" / "iter_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["lr_schedule"]
    meta_path.write_text(json.dumps(meta))
    cfg = load_config(["--load-checkpoint", ck, "--train-iters", "6"])
    assert cfg.optimizer.lr_decay_iters is None and lr_decay_length(cfg) == 6
    assert cfg.checkpoint.recorded.endswith("the checkpoint records no LR schedule (an older mimo-sft): it decays "
                                            "over --train-iters 6")
