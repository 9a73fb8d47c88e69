"""What the data path reads from a model folder without loading its processor: token ids and vision
geometry (config.json), and the ``validate`` note on an unset ``--max-pixels``; the preprocessor itself is
built here too, its heavy imports (transformers, torchvision through the image processor) made only then.

Why apart from ``data.loader``: ``validate`` reads this on every call, and the loader's module imports torch,
the preprocessing and transformers at its top (4.6 of validate's 4.95 s when it was imported there: issue 55
item 3). Only the preprocessor is heavy, and only a config whose processor may need a lower limit builds it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mimo_sft.errors import UserError


def model_token_info(model_dir: str | os.PathLike) -> dict:
    """Special token ids and vision geometry from the checkpoint's config.json (no transformers)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"model.hf_model: cannot read {path} ({err}); point --hf-model at a Qwen2.5-VL checkpoint folder") from None
    vc = cfg.get("vision_config", {})
    try:
        return {
            "image_token_id": int(cfg["image_token_id"]),
            "video_token_id": int(cfg.get("video_token_id", -1)),
            "vision_start_token_id": int(cfg["vision_start_token_id"]),
            "vision_end_token_id": int(cfg["vision_end_token_id"]),
            "spatial_merge_size": int(vc.get("spatial_merge_size", 2)),
            "patch_size": int(vc.get("patch_size", 14)),
            "temporal_patch_size": int(vc.get("temporal_patch_size", 2)),
        }
    except KeyError as err:
        raise UserError(f"model.hf_model: {path} lacks {err}; is this a Qwen2.5-VL checkpoint?") from None


def video_options(data_cfg):
    """The clip settings under ``data`` (``data.video.VideoOptions``)."""
    from mimo_sft.data.video import VideoOptions

    return VideoOptions(fps=float(data_cfg.video_fps), min_frames=data_cfg.video_min_frames,
                        max_frames=data_cfg.video_max_frames, min_pixels=data_cfg.video_min_pixels,
                        max_pixels=data_cfg.video_max_pixels, total_pixels=data_cfg.video_total_pixels,
                        cap_pixels_per_frame=bool(data_cfg.video_cap_pixels_per_frame))


def build_preprocessor(data_cfg, model_dir):
    """The ``data.preprocess.SamplePreprocessor`` of these data flags and this checkpoint."""
    from mimo_sft.data.preprocess import SamplePreprocessor

    return SamplePreprocessor(model_dir, seq_length=data_cfg.seq_length, min_pixels=data_cfg.min_pixels,
                              max_pixels=data_cfg.max_pixels, max_image_pixels=data_cfg.max_image_pixels,
                              video=video_options(data_cfg), image_backend=data_cfg.image_backend)


def fitted_pixels_note(data_cfg, model_dir) -> str | None:
    """``validate``'s line when ``--max-pixels`` is unset and the checkpoint's limit lets one image pass
    ``--seq-length`` (the preprocessor then lowers it: ``SamplePreprocessor.fitted_note``); None otherwise.
    The processor is loaded only where config.json and preprocessor_config.json say it may matter."""
    from mimo_sft.memory.check import processor_max_pixels

    if data_cfg.max_pixels is not None or not model_dir or not os.path.isdir(model_dir):
        return None
    try:
        info = model_token_info(model_dir)
    except UserError:
        return None  # check 16 says what is wrong with the folder
    limit = processor_max_pixels(model_dir) or 0
    factor = info["patch_size"] * info["spatial_merge_size"]
    if int(limit) // (factor * factor) < data_cfg.seq_length - 64:  # fits with room for the template's tokens
        return None
    return build_preprocessor(data_cfg, model_dir).fitted_note()
