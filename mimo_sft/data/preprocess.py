"""Turn one canonical sample into model inputs, with or without decoding its pixels.

Why it is written this way: language-only ranks must produce exactly the same ``input_ids``,
``labels``, ``loss_mask``, ``attention_mask`` and ``position_ids`` as vision ranks while never
decoding pixels. So there is ONE text path, driven by each image's grid, and the grid comes from
the image *header* (size + EXIF orientation) through transformers' own ``smart_resize``. The pixel
path only adds ``pixel_values`` and asserts the image processor produced the same grid.

Text: the checkpoint's chat template is rendered by transformers (``render_jinja_template``) with the
assistant turns' spans (``{% generation %}`` blocks, or from prefixes: ``data.template_spans``), each
``<|image_pad|>`` is expanded to ``t*h*w / merge**2`` copies (a clip's ``<|video_pad|>`` to its tokens), and
the whole string is tokenized once (offsets map the assistant spans to tokens, as transformers does).
Positions: the family's transformers ``get_rope_index`` (e.g. ``Qwen2_5_VLModel``'s) run on a small stand-in object.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from mimo_sft.data.processor import _pil_kwargs, load_processor, resolve_image_backend
from mimo_sft.data.images import (PIL_BOMB_LIMIT, _SWAP_ORIENTATIONS, decode_rgb, header_orientation, image_where,  # noqa: F401
                                   open_sample_image)
from mimo_sft.data.image_refs import VideoRef
from mimo_sft.data.video import ClipPlan, VideoOptions
from mimo_sft.data.template_spans import has_generation_markers, marked_spans, prefix_spans
from mimo_sft.data.template_spans import render as render_text
from mimo_sft.errors import BadSampleError, UserError


class _RopeIndex:
    """Just enough of the family's transformers model (``FamilySpec.rope_index``, e.g. ``Qwen2_5_VLModel``)
    for its ``get_rope_index`` (reads only ``config``)."""

    def __init__(self, config):
        import importlib

        from mimo_sft.config.families import default_family, family_for_model_type

        spec = family_for_model_type(getattr(config, "model_type", None)) or default_family()
        module, _, cls = spec.rope_index.partition(":")
        self.config = config
        self._cls = getattr(importlib.import_module(module), cls)

    def get_vision_position_ids(self, *args, **kwargs):
        return self._cls.get_vision_position_ids(self, *args, **kwargs)

    def get_rope_index(self, *args, **kwargs):
        return self._cls.get_rope_index(self, *args, **kwargs)

    def __getstate__(self):
        return {"config": self.config}

    def __setstate__(self, state):
        self.__init__(state["config"])


class TruncatedImageError(Exception):
    """A sample whose image tokens do not fit in ``seq_length`` (internal; the loader decides)."""

    def __init__(self, idx: int, needed: int, seq_length: int):
        super().__init__(f"sample {idx}: its image tokens end at token {needed} but --seq-length is {seq_length}")
        self.idx, self.needed, self.seq_length = idx, needed, seq_length


@dataclass
class ImageSpec:
    """What both paths need per image: its grid, and (pixel path) the reference to decode."""

    grid: tuple[int, int, int]
    ref: object
    orientation: int | None = None


class SamplePreprocessor:
    """Chat template + placeholder expansion + masks + mRoPE positions for one checkpoint.

    Picklable (DataLoader workers get a copy). ``min_pixels``/``max_pixels`` override the
    processor's own limits (``--min-pixels`` / ``--max-pixels``).
    """

    image_backend = "pil"  # set by __init__ (--image-backend)

    def __init__(self, model_dir: str | os.PathLike, *, seq_length: int, min_pixels: int | None = None,
                 max_pixels: int | None = None, max_image_pixels: int | None = PIL_BOMB_LIMIT,
                 video: VideoOptions | None = None, image_backend: str = "pil"):
        from transformers import AutoConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from mimo_sft.data.processor import _pil_kwargs

        processor = load_processor(model_dir)
        self.model_dir = str(model_dir)  # what a cost file's key hashes (data.cost_file)
        self.tokenizer = processor.tokenizer
        self.chat_template = processor.chat_template
        ip = processor.image_processor
        kw = _pil_kwargs(ip)
        if min_pixels is not None:
            kw["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            kw["max_pixels"] = int(max_pixels)
        if kw["min_pixels"] > kw["max_pixels"]:
            raise UserError(f"--min-pixels {kw['min_pixels']} is larger than --max-pixels {kw['max_pixels']}; lower one of them")
        self.image_processor = Qwen2VLImageProcessorPil(**kw)
        self.min_pixels, self.max_pixels = kw["min_pixels"], kw["max_pixels"]
        self.patch_size, self.merge_size = int(ip.patch_size), int(ip.merge_size)
        #: uint8 values per patch the data path carries (C*P*P; the encoder tiles T on the device)
        self.pixel_dim = 3 * self.patch_size ** 2
        self.config = AutoConfig.from_pretrained(str(model_dir))
        self.image_token_id = int(self.config.image_token_id)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        if self.tokenizer.convert_tokens_to_ids(processor.image_token) != self.image_token_id:
            raise UserError(f"model.hf_model {model_dir}: config.json image_token_id {self.image_token_id} is not the "
                            f"tokenizer's {processor.image_token}; the checkpoint's config and tokenizer disagree")
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                          else self.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        self.seq_length = int(seq_length)
        self.max_image_pixels = max_image_pixels  # largest file accepted before resizing (None/0: any)
        self._rope = _RopeIndex(self.config)
        #: transformers' image backend whose resize the pixels follow ("pil" or "torchvision": data.processor)
        self.image_backend = resolve_image_backend(image_backend)
        self.video_options = video or VideoOptions()
        #: what a cost file's counts depend on (``data.cost_file.SETTING_FLAGS``), as plain values
        self.video_settings = json.dumps(vars(self.video_options), sort_keys=True)
        self.video_token_id = int(getattr(self.config, "video_token_id", -1) or -1)
        self.video_token = self.tokenizer.convert_ids_to_tokens(self.video_token_id) if self.video_token_id >= 0 else None
        self._clips = None  # data.video.ClipReader, made at the first clip (it needs torchvision)
        self._special = dict(self.tokenizer.special_tokens_map)
        self._marked = has_generation_markers(self.chat_template)  # else spans from prefixes (data.template_spans)
        #: the checkpoint's own limit, and (``--max-pixels`` unset) the lower one chosen so that one image fits
        #: ``--seq-length`` with the chat template's tokens around it (None: the checkpoint's fits already)
        self.processor_max_pixels, self.fitted_max_pixels = self.max_pixels, None
        if max_pixels is None:
            fit = self.largest_fitting_pixels()
            if kw["min_pixels"] <= fit < self.max_pixels:
                self.max_pixels = self.fitted_max_pixels = fit
                self.image_processor = Qwen2VLImageProcessorPil(**{**kw, "max_pixels": fit})

    def largest_fitting_pixels(self) -> int:
        """The largest ``max_pixels`` at which a conversation of one image and a one-token answer fits
        ``--seq-length``: one merged patch (``(patch * merge)^2`` pixels) per placeholder token, after the
        template's own tokens (those of the same conversation with one placeholder, less that one)."""
        factor = self.patch_size * self.merge_size
        msgs = [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
        ids, _ = self.tokens(msgs, [(1, self.merge_size, self.merge_size)], -1, masks=False)
        return max(0, self.seq_length - (len(ids) - 1)) * factor * factor

    def fitted_note(self) -> str | None:
        """The line that says ``--max-pixels`` was lowered to fit ``--seq-length`` (None: it was not)."""
        if self.fitted_max_pixels is None:
            return None
        return (f"images above {self.fitted_max_pixels / 1e6:.3g} Mpx are downscaled to fit --seq-length "
                f"{self.seq_length} (the checkpoint allows {self.processor_max_pixels / 1e6:.3g} Mpx); set "
                f"--max-pixels to choose another limit")

    # ------------------------------------------------------------------ images

    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for an image of this size, by transformers' ``smart_resize``."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        try:
            rh, rw = smart_resize(height, width, factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as err:
            raise UserError(f"image of {width}x{height} pixels cannot be used ({err}); crop or remove it") from None
        return (1, rh // self.patch_size, rw // self.patch_size)

    @property
    def clips(self):
        """The family's clip reader (``data.video``), made at the first clip: image-only runs need no torchvision."""
        if self._clips is None:
            from mimo_sft.config.families import default_family, family_for_model_type
            from mimo_sft.data.video import ClipReader

            if self.video_token is None:
                raise UserError(f"model.hf_model {self.model_dir}: config.json has no video_token_id; this "
                                "checkpoint cannot take video rows")
            spec = family_for_model_type(getattr(self.config, "model_type", None)) or default_family()
            self._clips = ClipReader(self.model_dir, getattr(self.config, "model_type", None), self.video_options,
                                     timestamps=spec.video_timestamps)
        return self._clips

    def image_specs(self, refs, idx: int) -> list:
        """Grids from image headers and clip headers only: no pixel is decoded. A clip's entry is its
        ``data.video.ClipPlan`` (fewer frames or pixels when it alone would not fit ``--seq-length``)."""
        specs = []
        for ref in refs:
            if isinstance(ref, VideoRef):
                specs.append(self.clips.plan(ref, idx, token_budget=self.seq_length - 16))
                continue
            img = open_sample_image(ref, idx, max_image_pixels=self.max_image_pixels)
            w, h = img.size
            orientation = header_orientation(img)
            if orientation in _SWAP_ORIENTATIONS:
                w, h = h, w
            try:
                grid = self.grid_for_size(h, w)
            except UserError as err:
                raise BadSampleError(idx, image_where(ref), str(err)) from None
            specs.append(ImageSpec(grid, ref, orientation))
        return specs

    def pixels(self, specs: list[ImageSpec], idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode, orient (by the header's EXIF tag, as the grid was) and patchify the images."""
        if any(isinstance(spec, ClipPlan) for spec in specs):
            return self._mixed_pixels(specs, idx)
        images = [decode_rgb(spec.ref, idx, orientation=spec.orientation, max_image_pixels=self.max_image_pixels)
                  for spec in specs]
        # numpy, not torch: concatenation then stays single-threaded (torch's intra-op pool in a
        # busy training process made this path 3x slower in bench_data.py)
        patches, grids = zip(*(self._uint8_patches(img) for img in images))
        grid = torch.tensor(grids, dtype=torch.int64)
        expected = torch.tensor([s.grid for s in specs], dtype=torch.int64)
        assert torch.equal(grid, expected), f"sample {idx}: pixel grid {grid.tolist()} != header grid {expected.tolist()}"
        return torch.from_numpy(np.concatenate(patches, 0)), grid

    def _mixed_pixels(self, specs: list, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and clips of one sample in their order: each item's uint8 rows and its pixel grid (a clip's
        has ``t * temporal_patch_size`` frame rows: ``model.pixels``)."""
        rows, grids = [], []
        for spec in specs:
            if isinstance(spec, ClipPlan):
                patches, grid = self.clips.pixels(spec, idx)
            else:
                p, g = self.pixels([spec], idx)
                patches, grid = p.numpy(), tuple(g[0].tolist())
            rows.append(patches)
            grids.append(grid)
        return torch.from_numpy(np.concatenate(rows, 0)), torch.tensor(grids, dtype=torch.int64)

    def fitted_specs(self, messages: list[dict], refs, idx: int) -> tuple[list, tuple[torch.Tensor, torch.Tensor]]:
        """The sample's vision items and ``tokens``. Where a clip makes the vision tokens run past
        ``--seq-length``, the largest clip is planned again within what is left (fewer frames, then smaller
        ones: ``ClipReader.plan``), at most three times; what still does not fit is truncated as an image would be."""
        specs = self.image_specs(refs, idx)
        out = self.tokens(messages, specs, idx)
        for _ in range(3):
            ids = out[0]
            vision = ((ids == self.image_token_id) | (ids == self.video_token_id)).nonzero()
            over = int(vision[-1]) + 1 - self.seq_length if len(vision) else 0
            clips = [i for i, sp in enumerate(specs) if isinstance(sp, ClipPlan)]
            if over <= 0 or not clips:
                break
            i = max(clips, key=lambda i: specs[i].tokens(self.merge_size))
            specs[i] = self.clips.plan(specs[i].ref, idx, token_budget=specs[i].tokens(self.merge_size) - over)
            out = self.tokens(messages, specs, idx)
        return specs, out

    def pixel_grids(self, specs: list) -> list[tuple[int, int, int]]:
        """The grids the pixel rows are cut by (a clip's temporal side in frames: :meth:`_mixed_pixels`)."""
        t = self.clips.temporal if any(isinstance(sp, ClipPlan) for sp in specs) else 1
        return [(g[0] * t, g[1], g[2]) if isinstance(sp, ClipPlan) else tuple(g)
                for sp, g in ((sp, sp.grid) for sp in specs)]

    def _uint8_patches(self, img) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One RGB image through the processor's own conversion and resize, cut into patches in the
        processor's order but kept as uint8 and without the temporal tile: ``[h*w, C*P*P]``, 3 bytes
        per pixel. ``model.pixels.float_patches`` (on the device) does the rescale, normalisation
        and tile the processor would do next."""
        ip, p, m = self.image_processor, self.patch_size, self.merge_size
        if self.image_backend == "torchvision":  # transformers' Qwen2VLImageProcessor: torchvision's resize on uint8
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

            if getattr(self, "_tv", None) is None or self._tv_for is not ip:
                self._tv, self._tv_for = Qwen2VLImageProcessor(**_pil_kwargs(ip)), ip
            tv = self._tv
            rgb = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()[None]
            chw = tv.resize(images=rgb, size=tv.size, resample=tv.resample, factor=p * m)[0].numpy()
        else:
            chw = ip.process_image(img, do_convert_rgb=True)
            chw = ip.resize(chw, size=ip.size, resample=ip.resample, factor=p * m)
        assert chw.dtype == np.uint8, chw.dtype
        c, height, width = chw.shape
        gh, gw = height // p, width // p
        x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        return np.ascontiguousarray(x).reshape(gh * gw, c * p * p), (1, gh, gw)

    # ------------------------------------------------------------------ text

    def render(self, messages: list[dict], idx: int | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(chat text, character spans of the assistant's turns): the ``{% generation %}`` blocks of a marked
        template, else what each turn adds to the rendering of the messages before it (``data.template_spans``)."""
        where = f"sample {idx}: " if idx is not None and idx >= 0 else ""
        spans = marked_spans if self._marked else prefix_spans
        return spans(self.chat_template, messages, self._special, where=where, origin=self.model_dir)

    def _placeholder_text(self, item) -> str:
        """What one rendered placeholder becomes: an image's tokens, or a clip's (with Qwen3-VL's
        ``<t seconds>`` and vision_start/end per temporal patch, as ``Qwen3VLProcessor`` writes them)."""
        merge2 = self.merge_size ** 2
        if not isinstance(item, ClipPlan):
            t, h, w = item.grid if isinstance(item, ImageSpec) else item
            return self.image_token * ((t * h * w) // merge2)
        t, h, w = item.grid
        if not item.timestamps:
            return self.video_token * ((t * h * w) // merge2)
        start, end = (self.tokenizer.convert_ids_to_tokens(int(self.config.vision_start_token_id)),
                      self.tokenizer.convert_ids_to_tokens(int(self.config.vision_end_token_id)))
        frame = start + self.video_token * ((h * w) // merge2) + end
        return "".join(f"<{item.timestamps[i]:.1f} seconds>" + frame for i in range(t))

    def tokens(self, messages: list[dict], items: list, idx: int, *, masks: bool = True):
        """(ids, assistant_mask) of the full (untruncated) sample with placeholders expanded; ``items`` are the
        vision items in order: image grids (or ``ImageSpec``) and clips (``ClipPlan``). ``masks=False``: the
        text alone is rendered and the mask is all False, for token counts."""
        if masks:
            text, spans = self.render(messages, idx)
        else:
            text, spans = render_text(self.chat_template, [messages], self._special)[0], []
        marks = [self.image_token] + ([self.video_token] if self.video_token else [])
        pieces = re.split("(" + "|".join(re.escape(m) for m in marks) + ")", text)
        found = pieces[1::2]
        kinds = [self.video_token if isinstance(it, ClipPlan) else self.image_token for it in items]
        if found != kinds:
            n_img, n_vid = found.count(self.image_token), len(found) - found.count(self.image_token)
            raise UserError(f"sample {idx}: the chat text has {n_img} '{self.image_token}' and {n_vid} video "
                            f"placeholder(s) for {kinds.count(self.image_token)} image(s) and "
                            f"{len(kinds) - kinds.count(self.image_token)} clip(s); remove literal placeholder "
                            "tokens from the text or fix the images/videos")
        out, shift_at = [pieces[0]], []  # shift_at: (original char position, extra chars inserted there)
        pos = len(pieces[0])
        for item, mark, piece in zip(items, pieces[1::2], pieces[2::2]):
            rep = self._placeholder_text(item)
            out.append(rep)
            out.append(piece)
            shift_at.append((pos, len(rep) - len(mark)))
            pos += len(mark) + len(piece)
        expanded = "".join(out)

        def moved(p: int) -> int:
            return p + sum(extra for at, extra in shift_at if at < p)

        enc = self.tokenizer._tokenizer.encode(expanded, add_special_tokens=False)
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in spans:  # same rule as transformers' apply_chat_template(return_assistant_tokens_mask)
            start, end = enc.char_to_token(moved(a)), enc.char_to_token(moved(b) - 1)
            if start is None:
                break
            mask[start: (end + 1 if end is not None else len(ids))] = True
        return ids, mask

    def position_ids(self, ids: torch.Tensor, mm: torch.Tensor, items: list) -> torch.Tensor:
        grids = [it.grid if isinstance(it, (ImageSpec, ClipPlan)) else it for it in items]
        images = [g for it, g in zip(items, grids) if not isinstance(it, ClipPlan)]
        clips = [it for it in items if isinstance(it, ClipPlan)]
        kw = {}
        if clips:
            kw["video_grid_thw"] = torch.tensor([c.grid for c in clips], dtype=torch.int64)
            if not clips[0].timestamps:  # Qwen2.5-VL: the temporal positions step by seconds per patch
                kw["second_per_grid_ts"] = torch.tensor([self.clips.temporal / c.sampled_fps for c in clips])
        grid_thw = torch.tensor(images, dtype=torch.int64) if images else None
        pos, _ = self._rope.get_rope_index(ids[None], mm[None], image_grid_thw=grid_thw, **kw)
        return pos[:, 0]

    # ------------------------------------------------------------------ one sample

    def encode(self, messages, refs, idx: int, *, need_pixels: bool) -> dict:
        """Unpadded per-sample tensors; raises ``TruncatedImageError`` if an image would be cut."""
        specs, (ids, amask) = self.fitted_specs(messages, refs, idx)
        grids = [s.grid for s in specs]
        n_real = len(ids)
        is_vid = ids == self.video_token_id
        is_img = (ids == self.image_token_id) | is_vid
        S = self.seq_length
        if n_real > S:
            if bool(is_img[S:].any()):
                last = int(is_img.nonzero()[-1]) + 1
                raise TruncatedImageError(idx, last, S)
        n = min(n_real, S)
        # labels[t] is the target of position t = ids[t+1]; supervised where that token is the assistant's
        nxt = torch.full((n,), self.pad_id, dtype=torch.int64)
        nxt_mask = torch.zeros(n, dtype=torch.bool)
        m = min(n, n_real - 1)
        nxt[:m] = ids[1:m + 1]
        nxt_mask[:m] = amask[1:m + 1]
        labels = torch.where(nxt_mask, nxt, torch.full_like(nxt, self.pad_id))
        ids, mm = ids[:n], is_img[:n].to(torch.int64) + is_vid[:n].to(torch.int64)  # 1: image, 2: video
        positions = self.position_ids(ids, mm, specs)
        if bool(is_vid.any()):  # the model splices every vision item's rows in at the image token (model.family)
            ids = torch.where(is_vid[:n], torch.full_like(ids, self.image_token_id), ids)
        sample = {
            "input_ids": ids,
            "labels": labels,
            "loss_mask": nxt_mask.to(torch.float32),
            "position_ids": positions,
            "mm_token_type_ids": mm,
            "grids": grids,
            "sample_id": int(idx),
            "n_tokens": n_real,
            # silent data changes, counted by the training loop: supervised tokens cut by seq_length,
            # an assistant turn with no text (it trains on the end-of-turn token alone)
            "answer_cut": int(amask[1:].sum()) > int(nxt_mask.sum()),
            "answer_empty": has_empty_answer(messages),
            "clips": [(len(sp.indices), sp.downsampled) for sp in specs if isinstance(sp, ClipPlan)],
        }
        if sample["clips"]:
            sample["pixel_grids"] = self.pixel_grids(specs)
        if need_pixels and specs:
            t0 = time.perf_counter()
            sample["pixel_values"], sample["image_grid_thw"] = self.pixels(specs, idx)
            if sample["clips"]:  # the metrics' video_decode_s (decode, resize and patchify of the clips and images)
                sample["video_decode_s"] = time.perf_counter() - t0
        return sample

    def blank_pixels(self, grids: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero pixels of the given grids: the stand-in for images whose header was read but whose
        pixels cannot be decoded, so the encoder still sees as many patches as the text has placeholders."""
        rows = sum(t * h * w for t, h, w in grids)
        return torch.zeros((rows, self.pixel_dim), dtype=torch.uint8), torch.tensor(grids, dtype=torch.int64)

    def text_only_stand_in(self, messages: list[dict], idx: int) -> dict:
        """The same row without its images and with nothing supervised: what a sample whose images
        cannot be read (missing file, unreadable header) becomes on every rank alike (all ranks read
        headers), so the ranks stay in step and the consumed-sample count is unchanged; it adds no loss."""
        stripped = [{**m, "content": [p for p in m["content"] if p["type"] not in ("image", "video")]} for m in messages]
        sample = self.encode(stripped, [], idx, need_pixels=False)
        sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        sample["labels"] = torch.full_like(sample["labels"], self.pad_id)
        return sample

    def min_tokens_for_one_image(self) -> int:
        """Tokens of the smallest conversation holding one image at ``max_pixels`` (seq_length check).

        ``smart_resize`` keeps ``h*w <= max_pixels``, so an image has at most
        ``max_pixels // (patch*merge)**2`` placeholders; the grid below has exactly that many.
        """
        factor = self.patch_size * self.merge_size
        n_max = max(1, self.max_pixels // (factor * factor))
        grid = (1, self.merge_size, self.merge_size * n_max)
        msgs = [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
        ids, _ = self.tokens(msgs, [grid], -1, masks=False)
        return len(ids)


def has_empty_answer(messages: list[dict]) -> bool:
    """Whether an assistant turn has no text (whitespace only): it would train on ``<|im_end|>`` alone."""
    return any(m["role"] == "assistant" and not "".join(p.get("text") or "" for p in m["content"]
                                                          if p["type"] == "text").strip() for m in messages)


def collate(samples: list[dict], *, pad_id: int, seq_length: int | None, need_pixels: bool,
            pixel_dim: int = 0) -> dict:
    """Right-pad per-sample tensors into the design.md micro-batch dict (CPU tensors)."""
    B = len(samples)
    S = seq_length if seq_length is not None else max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.int64)
    labels = torch.full((B, S), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((B, S), dtype=torch.float32)
    attention_mask = torch.zeros((B, S), dtype=torch.bool)
    position_ids = torch.zeros((3, B, S), dtype=torch.int64)
    mm = torch.zeros((B, S), dtype=torch.int64)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[b, :n] = s["input_ids"]
        labels[b, :n] = s["labels"]
        loss_mask[b, :n] = s["loss_mask"]
        attention_mask[b, :n] = True
        position_ids[:, b, :n] = s["position_ids"]
        mm[b, :n] = s["mm_token_type_ids"]
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "mm_token_type_ids": mm,
        "image_counts": torch.tensor([len(s["grids"]) for s in samples], dtype=torch.int64),
        "sample_ids": torch.tensor([s["sample_id"] for s in samples], dtype=torch.int64),
        "answer_cut": torch.tensor([bool(s.get("answer_cut", False)) for s in samples], dtype=torch.bool),
        "answer_empty": torch.tensor([bool(s.get("answer_empty", False)) for s in samples], dtype=torch.bool),
    }
    if need_pixels:
        pv = [s["pixel_values"] for s in samples if "pixel_values" in s]
        grids = [s["image_grid_thw"] for s in samples if "image_grid_thw" in s]
        if pv:
            batch["pixel_values"] = torch.from_numpy(np.concatenate([t.numpy() for t in pv], 0))
            batch["image_grid_thw"] = torch.cat(grids, 0)
        else:
            # a text-only micro-batch on an encoder rank: empty tensors of the right width
            batch["pixel_values"] = torch.zeros((0, pixel_dim), dtype=torch.uint8)
            batch["image_grid_thw"] = torch.zeros((0, 3), dtype=torch.int64)
    return batch
