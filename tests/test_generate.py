"""``mimo-sft generate`` (issue 44 item 7): a checkpoint's answers are transformers' ``generate`` on the folder
``mimo-sft export`` writes, token for token -- greedy and sampled with a seed, full and LoRA checkpoints --
with the base model's answers beside them on request, and bad prompts refused in one line.

The checkpoints are made in this process (the tiny Qwen2.5-VL, every weight moved, saved as a run saves its
model: ``model_sharded_state_dict`` into a megatron dist checkpoint, with the meta.json naming the base), so no
training launch is spent. The reference never touches mimo-sft's generate path: the exported folder loaded with
``AutoModelForImageTextToText`` and ``AutoProcessor``, each prompt built with the processor's
``apply_chat_template(tokenize=True)`` from PIL images, and its ``generate``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from model_helpers import trained_lora_model
from train_helpers import tiny_model

GREEDY = {"max_new_tokens": 8, "do_sample": False, "repetition_penalty": 1.0}
SAMPLED = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.9, "top_p": 0.8, "top_k": 0,
           "repetition_penalty": 1.0}
SEED = 11
QUESTION = "What colour is shown in the image?"


def _save(model, folder: str, meta: dict) -> str:
    """``model``'s weights as a run's checkpoint holds them (a LoRA model's: what trains), and meta.json."""
    from mimo_sft.train.checkpoint.model import model_sharded_state_dict  # before megatron: mimo_sft's import shims

    from megatron.core import dist_checkpointing

    os.makedirs(os.path.join(folder, "model"))
    dist_checkpointing.save(model_sharded_state_dict(model), os.path.join(folder, "model"))
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump({"step": 1, "consumed_samples": 8, "dtype": "fp32", **meta}, fh)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base folder, full checkpoint, LoRA checkpoint, messages prompts file, LLaVA prompts file, the
    prompts as conversations with PIL images for the reference)."""
    from PIL import Image

    from mimo_sft.model import build_single_process_model

    root = tmp_path_factory.mktemp("generate")
    src = tiny_model()
    model, _ = build_single_process_model(src)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    full = _save(model, str(root / "full"), {"hf_model": src})
    del model
    lora_model, _, spec = trained_lora_model(src)
    lora = _save(lora_model, str(root / "lora"), {"hf_model": src, "lora": {
        **spec.to_dict(), "freeze_vision": False, "freeze_projector": False, "freeze_language": False}})
    del lora_model

    (root / "img").mkdir()
    Image.new("RGB", (60, 40), (200, 30, 30)).save(root / "img" / "red.png")
    Image.radial_gradient("L").resize((90, 70)).convert("RGB").save(root / "img" / "grad.png")
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/red.png"},
                                                   {"type": "text", "text": QUESTION}]}]},
        {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hello, how are you today?"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe the image."},
                                                   {"type": "image", "image": "img/grad.png"}]},
                      {"role": "assistant", "content": "The image shows the number and the colour."},
                      {"role": "user", "content": "What colour is it?"}]},
    ]
    messages = root / "prompts.jsonl"
    messages.write_text("".join(json.dumps(r) + "\n" for r in rows))
    llava = root / "llava.jsonl"  # the first prompt again, as LLaVA writes it
    llava.write_text(json.dumps({"image": "img/red.png", "conversations": [
        {"from": "human", "value": f"<image>\n{QUESTION}"}]}) + "\n")

    def pil(name):
        return Image.open(root / "img" / name).convert("RGB")

    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": pil("red.png")}, {"type": "text", "text": QUESTION}]}],
        [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
         {"role": "user", "content": [{"type": "text", "text": "Hello, how are you today?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Describe the image."}, {"type": "image", "image": pil("grad.png")}]},
         {"role": "assistant", "content": [{"type": "text", "text": "The image shows the number and the colour."}]},
         {"role": "user", "content": [{"type": "text", "text": "What colour is it?"}]}],
    ]
    return {"root": root, "src": src, "full": full, "lora": lora, "prompts": str(messages), "llava": str(llava),
            "conversations": conversations}


def _reference(folder: str, conversations: list, kwargs: dict) -> list[list[int]]:
    """transformers alone: ``generate``'s new tokens for each conversation, torch seeded with SEED before each."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import mimo_sft.data.processor  # noqa: F401 - registers the image-only processor the folder names

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    out = []
    for conversation in conversations:
        inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        torch.manual_seed(SEED)
        with torch.no_grad():
            ids = model.generate(**inputs, **kwargs)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def _ours(target: str, prompts: str, decodings: list, exported: str, dtype=None) -> list[list[list[int]]]:
    """mimo-sft's new tokens for each prompt under each of ``decodings``; first, its in-memory model is
    checked to be transformers' model of ``exported``, every tensor bit for bit and in the same dtype."""
    from transformers import AutoModelForImageTextToText

    from mimo_sft.generate import answer_ids, build_processor, load_trained, read_prompts

    model, src, _ = load_trained(target, hf_model=None, dtype=dtype)
    want = AutoModelForImageTextToText.from_pretrained(exported).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    processor, rows = build_processor(src or target), read_prompts(prompts)  # the image backend AutoProcessor picks
    return [answer_ids(model, processor, rows, d, torch.device("cpu")) for d in decodings]


def _decode(folder: str, ids: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok.decode(one, skip_special_tokens=True) for one in ids]


def _cli(*args: str):
    """``mimo-sft generate ARGS`` in this process; the library log levels its ``quiet_libraries`` lowers are
    put back for the tests that run after it in this worker."""
    import logging

    from transformers.utils import logging as hf_logging

    from mimo_sft.cli import app

    megatron, transformers = logging.getLogger("megatron").level, hf_logging.get_verbosity()
    try:
        return CliRunner().invoke(app, ["generate", *args])
    finally:
        logging.getLogger("megatron").setLevel(megatron)
        hf_logging.set_verbosity(transformers)


def _answers(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_answers_are_transformers_generate_on_the_export_token_for_token(setup):
    """Full checkpoint: greedy and seeded sampling give exactly the export's tokens; the CLI writes their text
    in prompt order; --compare-base writes the base folder's answers, which the moved weights change; the
    exported folder given as a plain HF folder (prompts in LLaVA's format) answers the same."""
    from mimo_sft.generate import Decoding
    from mimo_sft.train.export import export_checkpoint

    exported = export_checkpoint(setup["full"], str(setup["root"] / "full_hf"))
    conversations = setup["conversations"]
    greedy = _reference(exported, conversations, GREEDY)
    sampled = _reference(exported, conversations, SAMPLED)
    assert greedy != sampled, "sampling at temperature 0.9 should leave the greedy path somewhere"
    assert all(len(ids) > 0 for ids in greedy)
    assert _ours(setup["full"], setup["prompts"], [Decoding(max_new_tokens=8),
                 Decoding(max_new_tokens=8, temperature=0.9, top_p=0.8, seed=SEED)], exported) == [greedy, sampled]

    out = setup["root"] / "answers" / "full.jsonl"
    got = _cli(setup["full"], "--prompts", setup["prompts"], "--out", str(out), "--max-new-tokens", "8",
               "--compare-base")
    assert got.exit_code == 0, got.output
    base = _reference(setup["src"], conversations, GREEDY)
    assert base != greedy, "the checkpoint's weights were all moved: some answer must change"
    assert _answers(out) == [{"answer": a, "base_answer": b}
                             for a, b in zip(_decode(exported, greedy), _decode(exported, base))]

    folder_out = setup["root"] / "answers" / "folder.jsonl"
    got = _cli(exported, "--prompts", setup["llava"], "--out", str(folder_out), "--max-new-tokens", "8",
               "--temperature", "0.9", "--top-p", "0.8", "--seed", str(SEED))
    assert got.exit_code == 0, got.output
    assert _answers(folder_out) == [{"answer": _decode(exported, sampled)[0]}]


def test_clip_prompt_answers_as_transformers_on_the_export(setup, tmp_path):
    """A prompt with a clip: the answer is transformers' generate on the exported folder, its frames read by
    transformers' own PyAV reader with its video processor's sampling at 2 fps (Qwen2.5-VL's
    second_per_grid_ts from them), through transformers' Qwen2_5_VLProcessor."""
    import functools

    from transformers import (AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLProcessor,
                              Qwen2VLVideoProcessor)
    from transformers.video_utils import load_video

    from mimo_sft.testing.clips import write_clip
    from mimo_sft.train.export import export_checkpoint

    pytest.importorskip("torchvision")
    clip = write_clip(tmp_path / "clip.mp4", frames=30, width=72, height=56, fps=15)
    prompts = tmp_path / "clip_prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video", "video": str(clip)}, {"type": "text", "text": QUESTION}]}]}) + "\n")
    out = tmp_path / "clip_answers.jsonl"
    got = _cli(setup["full"], "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8", "--cpu")
    assert got.exit_code == 0, got.output
    exported = export_checkpoint(setup["full"], str(tmp_path / "clip_hf"))
    tok = AutoTokenizer.from_pretrained(exported)
    vp = Qwen2VLVideoProcessor.from_pretrained(exported)
    proc = Qwen2_5_VLProcessor(image_processor=AutoImageProcessor.from_pretrained(exported), tokenizer=tok,
                               video_processor=vp, chat_template=tok.chat_template)
    frames, meta = load_video(str(clip), backend="pyav", sample_indices_fn=functools.partial(vp.sample_frames, fps=2))
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = proc.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
    assert int((inputs["input_ids"] == proc.video_token_id).sum()) > 0
    model = AutoModelForImageTextToText.from_pretrained(exported).eval()
    with torch.no_grad():
        ids = model.generate(**inputs, **GREEDY)
    want = tok.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert _answers(out) == [{"answer": want}]


def test_lora_checkpoint_answers_as_its_merged_export(setup):
    """A LoRA checkpoint (adapters and the trained tower only) answers as transformers on its merged export."""
    from mimo_sft.generate import Decoding
    from mimo_sft.train.export import export_checkpoint

    exported = export_checkpoint(setup["lora"], str(setup["root"] / "lora_hf"))
    decoding = Decoding(max_new_tokens=8, temperature=0.9, top_p=0.8, seed=SEED)
    want = _reference(exported, setup["conversations"], SAMPLED)
    assert _ours(setup["lora"], setup["prompts"], [decoding], exported) == [want]
    assert want != _reference(setup["src"], setup["conversations"], SAMPLED), "the adapters change the answers"


def test_bf16_answers_as_the_bf16_export(setup):
    """--dtype bf16 converts as ``export --dtype bf16`` does: the same bf16 tensors, the same greedy tokens."""
    from mimo_sft.generate import Decoding
    from mimo_sft.train.export import export_checkpoint

    exported = export_checkpoint(setup["full"], str(setup["root"] / "full_bf16"), dtype="bf16")
    want = _reference(exported, setup["conversations"], GREEDY)
    assert _ours(setup["full"], setup["prompts"], [Decoding(max_new_tokens=8)], exported, dtype="bf16") == [want]


@pytest.mark.parametrize("case", ["no_file", "answered", "no_user", "no_image", "hf_base", "top_p"])
def test_bad_input_is_one_line_and_exit_2(setup, tmp_path, case):
    """A missing prompts file, a row that ends with the answer or has no user turn, a missing image,
    --compare-base on a plain folder and a bad --top-p: one line naming what to fix, exit 2, before any model."""
    prompts = tmp_path / "p.jsonl"
    rows = {"answered": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            "no_user": [{"role": "system", "content": "Be brief."}],
            "no_image": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}, {"type": "text", "text": "?"}]}]}
    prompts.write_text(json.dumps({"messages": rows.get(case, [{"role": "user", "content": "Hi"}])}) + "\n")
    target = setup["src"] if case == "hf_base" else setup["full"]
    extra = {"hf_base": ["--compare-base"], "top_p": ["--temperature", "1", "--top-p", "1.5"]}.get(case, [])
    got = _cli(target, "--prompts", str(tmp_path / "none.jsonl") if case == "no_file" else str(prompts),
               "--out", str(tmp_path / "a.jsonl"), *extra)
    want = {"no_file": "--prompts", "answered": "ends with an assistant turn", "no_user": "no user turn",
            "no_image": "gone.png", "hf_base": "--compare-base", "top_p": "--top-p"}[case]
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert got.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], got.output
    assert not (tmp_path / "a.jsonl").exists()
