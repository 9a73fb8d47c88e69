"""``mimo-sft generate``: a checkpoint's answers to prompts, as transformers' ``generate`` gives them.

What it runs is transformers' model and ``generate``, not ours: the answers must be the ones a user
gets from the folder ``mimo-sft export`` writes, token for token, so the checkpoint's weights are
converted as the export converts them, one decoder layer / vision block at a time, and loaded into
transformers' model in memory (``train.export.checkpoint_hf_weights`` -> ``model.hf_model``); no
export is written. A LoRA checkpoint's adapters are merged as the export merges them. A plain
Hugging Face folder is loaded as it is.

Prompts are rows in any format training reads (``data.sources``: messages, ShareGPT/LLaVA, images in a
column or named in the content, paths relative to the prompts file or ``--image-root``) that end
before the answer. Each is rendered with the folder's chat template and its generation prompt, its
images decoded as training decodes them (EXIF orientation, transparency onto white), and run through
the image-only processor (``data.processor``: no torchvision). One prompt at a time (no padding that
could change an answer). Decoding is what the flags say and nothing else: greedy by default; with
``--temperature`` > 0, sampling at that temperature with ``--top-p`` (no top-k, no repetition
penalty, whatever the folder's generation_config.json suggests -- its end-of-turn tokens do apply),
torch seeded with ``--seed`` before each prompt, so an answer does not depend on the prompts before it.

One process, no torchrun; the device is chosen once (``parallel.runtime.select_device``): the GPU
when there is one, else the CPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mimo_sft.errors import UserError


@dataclass(frozen=True)
class Decoding:
    """How each answer is decoded (the flags)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> "Decoding":
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {self.max_new_tokens}: give at least 1")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature:g}: give 0 (greedy) or a positive temperature")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p:g}: give a value in (0, 1]")
        return self

    def generate_kwargs(self) -> dict:
        """``model.generate``'s keyword arguments: greedy at temperature 0, else temperature and top-p sampling."""
        if self.temperature == 0:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False, "repetition_penalty": 1.0}
        return {"max_new_tokens": self.max_new_tokens, "do_sample": True, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": 0, "repetition_penalty": 1.0}


@dataclass
class Prompt:
    """One prompt row: canonical messages (``data.rows``) and its image references."""

    row: int
    messages: list
    refs: list


# ---- prompts ---------------------------------------------------------------------------------------

def read_prompts(path: str, *, image_root: str | None = None) -> list[Prompt]:
    """Every row of ``path`` as a :class:`Prompt`, read as training reads a dataset; every image header
    opened (missing or unreadable files refused now, before a model is built)."""
    from mimo_sft.config.schema import DataConfig
    from mimo_sft.data.images import open_sample_image
    from mimo_sft.data.sources import load_sft_dataset

    if not os.path.exists(path):
        raise UserError(f"--prompts {path}: file not found; give a .jsonl/.json/.parquet file of prompt rows")
    try:
        source = load_sft_dataset(DataConfig(dataset_path=path, image_root=image_root), check_files=False)
    except UserError as err:
        raise UserError(str(err).replace("--dataset-path", "--prompts")) from None
    from mimo_sft.data.image_refs import VideoRef
    from mimo_sft.data.video import read_header
    from mimo_sft.errors import BadSampleError

    prompts = []
    for i in range(len(source)):
        messages, refs = source[i]
        _check_prompt(path, i, messages)
        for ref in refs:
            try:
                read_header(ref, i) if isinstance(ref, VideoRef) else open_sample_image(ref, i)
            except BadSampleError as err:
                raise UserError(f"--prompts {path}, row {i}: {err.path}: {err.reason}") from None
        prompts.append(Prompt(i, messages, refs))
    return prompts


def _check_prompt(path: str, row: int, messages: list) -> None:
    if not any(m["role"] == "user" for m in messages):
        raise UserError(f"--prompts {path}, row {row}: no user turn; a prompt needs a user message to answer")
    if messages[-1]["role"] == "assistant":
        raise UserError(f"--prompts {path}, row {row}: ends with an assistant turn; leave the answer out of a "
                        f"prompt (generate writes it)")


def prompt_inputs(processor, prompt: Prompt) -> dict:
    """The processor's tensors for one prompt: its chat template with the generation prompt, its images
    decoded as training decodes them, its clips' frames planned and decoded as training does
    (``data.video``) and handed to transformers' processor with their metadata."""
    from mimo_sft.data.image_refs import VideoRef
    from mimo_sft.data.images import decode_rgb, header_orientation, open_sample_image

    text = processor.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    images = [decode_rgb(ref, prompt.row, orientation=header_orientation(open_sample_image(ref, prompt.row)))
              for ref in prompt.refs if not isinstance(ref, VideoRef)]
    clips = [ref for ref in prompt.refs if isinstance(ref, VideoRef)]
    if not clips:
        return processor(text=[text], images=images or None, return_tensors="pt")
    from transformers.video_utils import VideoMetadata

    from mimo_sft.data.video import decode_frames

    plans = [processor.clip_reader.plan(ref, prompt.row) for ref in clips]
    frames = [decode_frames(p.ref, p.indices, prompt.row) for p in plans]
    metadata = [VideoMetadata(total_num_frames=p.window_frames, fps=p.fps, frames_indices=p.indices,
                              width=p.size[1], height=p.size[0]) for p in plans]
    return processor(text=[text], images=images or None, videos=frames, video_metadata=metadata,
                     do_sample_frames=False, return_tensors="pt")


def build_processor(folder: str, *, image_backend: str = "auto", max_pixels: int | None = None,
                    videos: bool = False):
    """The processor generate feeds the model with, preprocessing as training did: the run's image backend
    (``--image-backend``, recorded in the checkpoint) and image limit (``max_pixels``: a fitted one included);
    with ``videos``, transformers' own processor class of the family with its video processor."""
    import json as _json

    from mimo_sft.data.processor import QwenVLImageOnlyProcessor, _pil_kwargs, load_processor, resolve_image_backend

    ours = load_processor(folder)
    kw = _pil_kwargs(ours.image_processor)
    if max_pixels:
        kw["max_pixels"] = int(max_pixels)
    if resolve_image_backend(image_backend) == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as ImageProcessor
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as ImageProcessor
    image_processor = ImageProcessor(**kw)
    if not videos:
        return QwenVLImageOnlyProcessor(image_processor, ours.tokenizer, chat_template=ours.chat_template)
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

    from mimo_sft.config.families import default_family, family_for_model_type
    from mimo_sft.data.video import ClipReader, VideoOptions

    model_type = _json.loads(Path(folder, "config.json").read_text()).get("model_type")
    spec = family_for_model_type(model_type) or default_family()
    reader = ClipReader(folder, model_type, VideoOptions(), timestamps=spec.video_timestamps)
    cls = Qwen3VLProcessor if spec.video_timestamps else Qwen2_5_VLProcessor
    processor = cls(image_processor=image_processor, tokenizer=ours.tokenizer, video_processor=reader.vp,
                    chat_template=ours.chat_template)
    processor.clip_reader = reader
    return processor


# ---- answers ---------------------------------------------------------------------------------------

def answer_ids(model, processor, prompts: list[Prompt], decoding: Decoding, device) -> list[list[int]]:
    """The new tokens ``model.generate`` writes for each prompt, one prompt at a time, torch seeded with
    ``decoding.seed`` before each."""
    import torch

    out = []
    kwargs = decoding.generate_kwargs()
    for prompt in prompts:
        inputs = prompt_inputs(processor, prompt).to(device)
        torch.manual_seed(decoding.seed)
        with torch.no_grad():
            ids = model.generate(**inputs, **kwargs)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def decode(processor, ids: list[list[int]]) -> list[str]:
    return [processor.tokenizer.decode(one, skip_special_tokens=True) for one in ids]


def is_hf_folder(path: str) -> bool:
    """A Hugging Face folder (config.json, no mimo-sft meta.json), as opposed to a checkpoint."""
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "meta.json"))


def load_trained(target: str, *, hf_model: str | None, dtype: str | None):
    """``(model, base folder or None, torch dtype)`` for a checkpoint (its weights in transformers' model
    of its base folder) or a plain Hugging Face folder (base None)."""
    from mimo_sft.model.export import EXPORT_DTYPES
    from mimo_sft.model.hf_model import model_from_folder, model_from_groups

    if not os.path.isdir(target):
        raise UserError(f"generate {target}: folder not found; give a mimo-sft checkpoint folder (or its parent with "
                        f"'latest') or a Hugging Face folder")
    if is_hf_folder(target):
        if dtype is not None and dtype not in EXPORT_DTYPES:
            raise UserError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
        model = model_from_folder(target, EXPORT_DTYPES[dtype][0] if dtype else "auto", flag="generate")
        return model, None, model.dtype
    from mimo_sft.train.export import checkpoint_hf_weights

    src, torch_dtype, groups = checkpoint_hf_weights(target, hf_model=hf_model, dtype=dtype)
    return model_from_groups(src, groups, torch_dtype), src, torch_dtype


def _checkpoint_meta(target: str) -> dict:
    """The checkpoint's meta.json (how its run preprocessed: image backend, image limit)."""
    from mimo_sft.train.checkpoint.files import read_meta, resolve_checkpoint

    return read_meta(resolve_checkpoint(target))


def generate(target: str, prompts_path: str, out: str, *, hf_model: str | None = None, dtype: str | None = None,
             decoding: Decoding = Decoding(), compare_base: bool = False, image_root: str | None = None,
             prefer: str = "auto") -> int:
    """``mimo-sft generate``: write ``out`` (one JSON object per prompt, in order: ``answer``, and
    ``base_answer`` with ``compare_base``). Returns the number of answers."""
    from mimo_sft.parallel import runtime

    decoding.check()
    if os.path.isdir(out):
        raise UserError(f"--out {out} is a folder; give the .jsonl file to write the answers into")
    if compare_base and os.path.isdir(target) and is_hf_folder(target):
        raise UserError(f"--compare-base: {target} is a Hugging Face folder, which has no base model; give a "
                        f"mimo-sft checkpoint (its meta.json names the base)")
    prompts = read_prompts(prompts_path, image_root=image_root)
    device = runtime.device() if runtime.device_chosen() else runtime.use_device(runtime.select_device(prefer))
    model, src, torch_dtype = load_trained(target, hf_model=hf_model, dtype=dtype)
    meta = _checkpoint_meta(target) if src else {}
    from mimo_sft.data.image_refs import VideoRef

    processor = build_processor(src or target, image_backend=meta.get("image_backend", "auto"),
                                max_pixels=meta.get("max_pixels"),
                                videos=any(isinstance(r, VideoRef) for p in prompts for r in p.refs))
    rows = [{"answer": a} for a in decode(processor, answer_ids(model.to(device), processor, prompts, decoding, device))]
    del model
    if compare_base:
        from mimo_sft.model.hf_model import model_from_folder

        base = model_from_folder(src, torch_dtype).to(device)
        for row, answer in zip(rows, decode(processor, answer_ids(base, processor, prompts, decoding, device))):
            row["base_answer"] = answer
        del base
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return len(rows)
