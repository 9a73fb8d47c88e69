"""Context parallelism in the language model under torchrun (gloo, CPU): each layout's step equals the
single-process step per parameter (``model.context_parallel``), on packed and padded rows of images, pages and
real clips (``e2e_runs.video_data``), for the three decoder kinds:

* Qwen2.5-VL: cp 4 colocated (encoder dp 4 fanning in to language dp 1) packed; language tp 2 x cp 2 with
  sequence parallelism fed by a non-colocated encoder rank, packed;
* Qwen3-VL (DeepStack: the features added at each cp rank's own positions, their gradient summed over tp x cp):
  tp 2 x cp 2 colocated with sequence parallelism, packed, selective recomputation; cp 4 colocated (the tower
  replicated on its 2 tp ranks) on padded rows with full recomputation;
* Qwen3.5 (Gated DeltaNet through megatron's own cp all-to-all; 4 key / 8 value GDN heads so that cp 4 divides
  them, 4 query heads over 2 KV heads: repeated K/V at cp 4): cp 2 non-colocated packed; cp 4 colocated packed.

Each is compared with its family's padded single-process run: the loss within 1e-6, every parameter's reduced
gradient within 1e-6 of its tensor's largest entry (fp32), the weights after the Adam step as the other layout
tests check them.
"""

import functools
import tempfile
from pathlib import Path

import pytest

from e2e_runs import (PACKED, SINGLE, VIDEO, assert_same_gradients, assert_same_step, layout_run,
                      video_data, video_reference)
from train_helpers import metrics

pytestmark = [pytest.mark.e2e]

#: the issue's bar: every parameter's gradient within 1e-6 of its tensor's largest entry (fp32)
EXACT = 1e-6
#: the weights after one Adam step follow the gradients to a tenth of one step (lr 1e-3), as test_deepstack_e2e.py
WEIGHTS_TOL = 1e-4
SP = ["--sequence-parallel"]


def _exact(ref, got, **kw):
    assert_same_step(ref, got, same_flops=False, weights_tol=WEIGHTS_TOL, **kw)
    assert_same_gradients(ref, got, rel=EXACT, loose=kw.get("loose"))
    a, b = metrics(ref)[0], metrics(got)[0]
    assert abs(a["loss"] - b["loss"]) <= EXACT * a["loss"], (a["loss"], b["loss"])


@functools.lru_cache(maxsize=None)
def tiny(family: str) -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="mimo_sft_cp_")) / family
    extra = {"gdn_heads": (4, 8)} if family == "qwen3_5" else {}
    return str(write_tiny_checkpoint(folder, seed=0, family=family, text_layers=4, **extra))


def run(family, name, nproc, components, extra=()):
    """One step (two micro-batches of 4) of the clips data on the family's tiny model, gradients saved."""
    return layout_run(name, nproc, components, video_data(), [*VIDEO, "--scalable-dp", *extra], model=tiny(family))


@functools.lru_cache(maxsize=None)
def family_reference(family: str) -> str:
    return layout_run(f"cp_ref_{family}", 1, SINGLE, video_data(), [*VIDEO, "--scalable-dp"], model=tiny(family))


@pytest.mark.xdist_group("e2e_cp_qwen2_5_vl")
def test_qwen2_5_vl_cp4_colocated_packed_reordered():
    """The colocated plan (index mode, the language term weighed in) places the samples on the 4 GPUs; a language
    slice's work counts over its tp x cp GPUs. The same samples, so the same step."""
    got = layout_run("cp4_co", 4, ("language=cp=4,dp=1", "images=dp=4"), video_data(),
                     [*VIDEO, "--scalable-dp", *PACKED, "--intra-microbatch-reorder", "--reorder-language-cost-weight",
                      "1"])
    _exact(video_reference(), got)
    m = metrics(got)[0]
    assert m["video_frames_decoded"] > 0
    assert m["gpu_load_max_over_mean_after"] <= m["gpu_load_max_over_mean_before"], m


@pytest.mark.xdist_group("e2e_cp_qwen2_5_vl")
def test_qwen2_5_vl_tp2_cp2_sequence_parallel_non_colocated_packed():
    got = layout_run("cp2_tp2_nc", 5, ("language=tp=2,cp=2,dp=1", "images=dp=1,rank_offset=4"), video_data(),
                     [*VIDEO, "--scalable-dp", *PACKED, *SP])
    _exact(video_reference(), got)


@pytest.mark.xdist_group("e2e_cp_qwen2_5_vl")
def test_qwen2_5_vl_lora_cp2_colocated_packed():
    """LoRA (rank 4, the default targets, dropout 0) at cp 2 against the single-process LoRA run: the adapters'
    gradients are partial per cp rank and summed by the DDP over dp x cp like the base weights'."""
    lora = ["--lora-rank", "4", "--lora-alpha", "8"]
    ref = layout_run("cp_lora_ref", 1, SINGLE, video_data(), [*VIDEO, *lora])
    got = layout_run("cp2_lora", 2, ("language=cp=2,dp=1", "images=dp=2"), video_data(),
                     [*VIDEO, "--scalable-dp", *PACKED, *lora])
    _exact(ref, got)


@pytest.mark.xdist_group("e2e_cp_qwen3_vl_moe")
def test_qwen3_vl_moe_cp2_ep2_colocated_packed():
    """Qwen3-VL-MoE (8 experts, top 2) at cp 2 with the experts split over ep 2 on the same two ranks: each cp
    rank routes its own positions, megatron's alltoall dispatcher carries them to the experts' ranks."""
    got = run("qwen3_vl_moe", "cp_moe_cp2", 2, ("language=cp=2,ep=2,dp=1", "images=dp=2"), PACKED)
    _exact(family_reference("qwen3_vl_moe"), got)


@pytest.mark.xdist_group("e2e_cp_qwen3_vl")
def test_qwen3_vl_deepstack_tp2_cp2_sequence_parallel_colocated_packed_selective_recompute():
    got = run("qwen3_vl", "cp_q3vl_tp2cp2", 4, ("language=tp=2,cp=2,dp=1", "images=dp=4"),
              [*PACKED, *SP, "--recompute-granularity", "selective", "--recompute-modules", "core_attn,mlp"])
    _exact(family_reference("qwen3_vl"), got)


@pytest.mark.xdist_group("e2e_cp_qwen3_vl")
def test_qwen3_vl_deepstack_cp4_colocated_padded_rows_full_recompute():
    got = run("qwen3_vl", "cp_q3vl_cp4", 4, ("language=cp=4,dp=1", "images=tp=2,dp=2"),
              ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"])
    _exact(family_reference("qwen3_vl"), got)


#: the GDN decay path's fp32 gradient moves with the summation order (test_qwen3_5_e2e.py's DECAY: measured up to
#: 7.5e-5 of its size between two layouts); every other parameter is held to EXACT
DECAY = {"self_attention.A_log": 1e-3, "self_attention.dt_bias": 1e-3, "self_attention.in_proj.weight.alpha": 1e-3}


@pytest.mark.xdist_group("e2e_cp_qwen3_5")
def test_qwen3_5_gdn_cp2_non_colocated_packed():
    got = run("qwen3_5", "cp_q35_cp2", 3, ("language=cp=2,dp=1", "images=dp=1,rank_offset=2"), PACKED)
    _exact(family_reference("qwen3_5"), got, loose=DECAY)


@pytest.mark.xdist_group("e2e_cp_qwen3_5")
def test_qwen3_5_gdn_cp4_colocated_packed():
    got = run("qwen3_5", "cp_q35_cp4", 4, ("language=cp=4,dp=1", "images=dp=4"), PACKED)
    _exact(family_reference("qwen3_5"), got, loose=DECAY)


# ---- checkpoints across cp sizes, a mixture's per-source losses, evaluation --------------------------------------
RESUME = ["--seq-length", "160", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
          "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--dataloader-type", "cyclic", "--seed", "7",
          "--no-tensorboard", "--scalable-dp", "--weight-decay", "0.05", "--save-interval", "2", "--eval-iters", "1",
          *PACKED]
CP = {1: ("language=dp=1", "images=dp=1"), 2: ("language=cp=2,dp=1", "images=dp=2"),
      4: ("language=cp=4,dp=1", "images=dp=4")}
SOURCES = ("docs", "chat")


def _resume_run(name, cp, iters, load=None):
    """The two-source mixture of test_mixture_e2e.py (each source with its validation set) at language cp."""
    from e2e_runs import finetune
    from test_mixture_e2e import _sources

    docs, chat, docs_valid, chat_valid = _sources()
    flags = [*RESUME, "--train-iters", str(iters), "--dataset-path", chat, "--dataset-weights", "0.7,0.3",
             "--valid-dataset-path", docs_valid, "--valid-dataset-path", chat_valid,
             *(["--load-checkpoint", load] if load else [])]
    return finetune(name, cp, flags, components=CP[cp], data=docs).out


def _by_step(run_dir, key):
    return {m["step"]: m for m in metrics(run_dir) if key in m}


@pytest.mark.xdist_group("e2e_cp_resume")
def test_checkpoints_reshard_between_cp_sizes_with_per_source_losses_and_evaluation():
    """A cp 2 run's checkpoint (the distributed optimizer's default DP-only form: its shards are over dp x cp)
    resumes at cp 1 and at cp 4, and checkpoints saved at cp 1 and cp 4 resume at cp 2: each resumed step's loss,
    gradient norm, per-source losses (each cp rank's positions attributed to their source) and validation losses
    (every cp rank's sums) equal the uninterrupted cp 2 run's within 1e-6 (another reduction order, not bit for
    bit)."""
    from e2e_runs import assert_continues

    cont = _resume_run("cp_cont", 2, 6)
    at1 = _resume_run("cp_2to1", 1, 4, load=cont + "/checkpoints/iter_0000002")
    at4 = _resume_run("cp_2to4", 4, 4, load=cont + "/checkpoints/iter_0000002")
    from1 = _resume_run("cp_1to2", 2, 6, load=at1 + "/checkpoints/iter_0000004")
    from4 = _resume_run("cp_4to2", 2, 6, load=at4 + "/checkpoints/iter_0000004")
    train, valid = _by_step(cont, "loss"), _by_step(cont, "valid_loss")
    for resumed, steps in ((at1, [3, 4]), (at4, [3, 4]), (from1, [5, 6]), (from4, [5, 6])):
        assert_continues(cont, resumed, steps, rel=EXACT)
        got, got_valid = _by_step(resumed, "loss"), _by_step(resumed, "valid_loss")
        for step in steps:
            for name in SOURCES:
                a, b = train[step].get(f"loss/{name}"), got[step].get(f"loss/{name}")
                assert (a is None) == (b is None) and (a is None or abs(a - b) <= EXACT * a), (step, name, a, b)
        assert sorted(got_valid) == [steps[-1]], sorted(got_valid)  # evaluated after its last step
        if steps[-1] in valid:  # the runs that end where the uninterrupted one does
            for key in ("valid_loss", *(f"valid_loss/{n}" for n in SOURCES)):
                a, b = valid[steps[-1]][key], got_valid[steps[-1]][key]
                assert abs(a - b) <= EXACT * a, (resumed, key, a, b)
    for m in train.values():  # at cp 2 the per-source losses weighted by their tokens are the logged loss
        weighted = sum(m[f"loss/{n}"] * m[f"tokens/{n}"] for n in SOURCES if f"loss/{n}" in m)
        assert abs(weighted / m["supervised_tokens"] - m["loss"]) <= EXACT * m["loss"], m
        assert sum(m[f"tokens/{n}"] for n in SOURCES) == m["supervised_tokens"]
    losses = [train[s]["loss"] for s in sorted(train)]
    assert losses[-1] < losses[0], losses  # it trains


# ---- a long clip: refused at cp 1, trains at cp 4 on the same GPU budget -------------------------------------
@functools.lru_cache(maxsize=None)
def long_clip_data() -> str:
    """One row: a 4-second 224 x 224 clip read at 30 frames a second (``--video-fps 30``; the video processor
    samples 64 of its 120 frames): 32 temporal patches of 64 merged tokens, 2,048 clip tokens."""
    import json

    from mimo_sft.testing.clips import write_clip
    from train_helpers import new_dir

    folder = Path(new_dir("long_clip"))
    folder.mkdir(parents=True)
    write_clip(folder / "long.mp4", frames=120, width=224, height=224, fps=30.0)
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": "long.mp4"},
                                                     {"type": "text", "text": "What happens in the clip?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "Colours move across."}]}]}
    (folder / "train.jsonl").write_text(json.dumps(row) + "\n")
    return str(folder / "train.jsonl")


LONG = ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
        "--video-fps", "30", "--lr", "1e-4", "--lr-warmup-iters", "0", "--no-tensorboard", "--dataloader-type",
        "cyclic", *PACKED]
LONG_CP = {1: ("language=dp=1", "images=dp=1"), 4: ("language=cp=4,dp=1", "images=tp=4,dp=1")}


@functools.lru_cache(maxsize=None)
def long_clip_model() -> str:
    """The tiny Qwen2.5-VL with a wider language model (hidden 256, 4 layers): its activations, not the fixed
    allowance, decide whether a 4,096-token row fits."""
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="mimo_sft_cp_long_")) / "qwen2_5_vl"
    return str(write_tiny_checkpoint(folder, seed=0, text_hidden=256, intermediate=1024, text_layers=4))


def _forecast(cp: int) -> dict:
    """check 23's forecast for the long-clip run at ``cp``, as finetune checks it on this machine (the CPU's
    kernels): the colocated GPU's peak and the language module's terms."""
    from mimo_sft.config.loader import load_config
    from mimo_sft.validate import check_config

    args = ["--hf-model", long_clip_model(), "--dataset-path", long_clip_data(), *LONG]
    for c in LONG_CP[cp]:
        args += ["--component", c]
    memory = check_config(load_config(args), for_run=True).memory
    (peak,) = memory["gpu_peaks"].values()
    return {"peak": peak, **memory["modules"]["language"]["terms"],
            "vision_activations": memory["modules"]["images"]["terms"]["activations"]}


@pytest.mark.xdist_group("e2e_cp_long_clip")
def test_a_long_clip_is_refused_at_cp1_and_trains_at_cp4_on_the_same_gpu_budget():
    """The forecast divides the language activations (and logits) by cp; a budget between the two forecasts
    refuses cp 1 before it trains (check 23) and lets cp 4 train the clip (64 frames sampled,
    2,048 clip tokens, split over 4 ranks). The tower, replicated on its 4 tp ranks (the cp group's GPUs), encodes
    the clip once between them: 8 of its 32 temporal patches each (``train.tower_split``), and its activations are
    forecast at that share (plus one temporal patch)."""
    from e2e_runs import finetune

    one, four = _forecast(1), _forecast(4)
    assert four["activations"] <= 0.26 * one["activations"] and four["logits"] <= 0.26 * one["logits"], (one, four)
    assert four["peak"] < 0.9 * one["peak"], (one, four)
    assert four["vision_activations"] <= (1 / 4 + 1 / 32) * one["vision_activations"] + 1, (one, four)
    budget = ["--gpu-memory-gb", f"{(one['peak'] * four['peak']) ** 0.5 / 1024 ** 3:.6f}"]
    refused = finetune("long_cp1", 1, [*LONG, *budget], components=LONG_CP[1], model=long_clip_model(),
                       data=long_clip_data(), check=False).proc
    assert refused.returncode != 0 and "[23] language (every rank) and images (every rank): forecast" in refused.stderr \
        and "exceeds --gpu-memory-gb" in refused.stderr, refused.stderr[-2000:]
    trained = finetune("long_cp4", 4, [*LONG, *budget], components=LONG_CP[4], model=long_clip_model(),
                       data=long_clip_data())
    m = metrics(trained.out)[0]
    # the clip's 64 sampled frames (32 temporal patches of 64 tokens) on every rank of the replicated tower; each
    # cp rank's language share is a quarter of the row's ~2,100 real tokens
    assert m["supervised_tokens"] > 0 and m["video_frames_decoded"] == 4 * 64, m
    assert sum(m["rank_tokens"]) > 2000 and len(set(m["rank_tokens"])) == 1, m["rank_tokens"]
    assert m["rank_patches"] == [32 * 256 / 4] * 4, m["rank_patches"]  # each replica encoded a quarter of the clip



#: the load-balancing loss's gradient reaches the tower through the image tokens, from sums taken over the cp group
#: in another order than one process's mean: the vision norms' small fp32 gradients moved by up to 1.03e-6 of
#: their largest entry in one full-suite run (7.3e-11 of 7.1e-5); every other parameter is held to EXACT
AUX_TOWER_NORMS = {"norm1.weight": 3e-6, "norm2.weight": 3e-6}


@pytest.mark.xdist_group("e2e_cp_qwen3_vl_moe")
def test_qwen3_vl_moe_load_balancing_loss_at_cp2_equals_one_process():
    """--moe-aux-loss-coeff under cp: each cp rank routes its own positions, so the Switch loss's sums (slots and
    probabilities per expert, tokens) are added over the cp group and each rank's part carries its tokens'
    gradient (train.expert_load.cp_aux_loss). The cp 2 step (the routers' gradients included) and the reported
    loss equal one packed process's; before, each rank took its own positions' loss and the gradient norm was 8x."""
    aux = ["--moe-aux-loss-coeff", "0.1", *PACKED]
    ref = layout_run("cp_moe_aux_ref", 1, SINGLE, video_data(), [*VIDEO, "--scalable-dp", *aux],
                     model=tiny("qwen3_vl_moe"))
    got = run("qwen3_vl_moe", "cp_moe_aux_cp2", 2, ("language=cp=2,ep=2,dp=1", "images=dp=2"), aux)
    both = run("qwen3_vl_moe", "cp_moe_aux_tp2cp2", 4, ("language=tp=2,cp=2,ep=2,dp=1", "images=dp=4"), [*aux, *SP])
    a = metrics(ref)[0]["moe_aux_loss"]
    assert a >= 1.0
    for run_dir in (got, both):  # cp, and sequence-parallel tp x cp: the sums over tp_cp
        _exact(ref, run_dir, loose=AUX_TOWER_NORMS)
        b = metrics(run_dir)[0]["moe_aux_loss"]
        assert abs(a - b) <= EXACT * a, (run_dir, a, b)
