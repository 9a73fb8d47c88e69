#!/usr/bin/env python
"""Write a tiny random Qwen-VL checkpoint of any family mimo-sft trains (Qwen2.5-VL, Qwen3-VL, Qwen3.5 and the
mixture-of-experts Qwen3-VL-MoE and Qwen3.5-MoE: --family, listed below), or a released architecture (--preset):
config, safetensors, image-only processor.

    python scripts/make_tiny_qwen_vl.py OUT_DIR [--seed N] [--text-hidden 64] ... [--config-only]
    python scripts/make_tiny_qwen_vl.py OUT_DIR --family qwen3_vl
    python scripts/make_tiny_qwen_vl.py OUT_DIR --preset qwen2.5-vl-3b --config-only
    python scripts/make_tiny_qwen_vl.py OUT_DIR --preset qwen3-vl-8b --config-only
    python scripts/make_tiny_qwen_vl.py OUT_DIR --preset qwen3.5-27b --config-only

--preset writes a released model's real architecture with Qwen's real tokenizer (built offline; Qwen3.5's
248k-entry one for the qwen3.5 presets);
--config-only writes no weights (train the folder with --allow-random-init). The size options
(--text-hidden ...) only apply to the tiny model.

The logic lives in ``mimo_sft.testing.tiny_checkpoint``; this is only the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mimo_sft.errors import UserError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vision-hidden", type=int, default=32)
    p.add_argument("--vision-depth", type=int, default=2)
    p.add_argument("--vision-heads", type=int, default=2)
    p.add_argument("--text-hidden", type=int, default=64)
    p.add_argument("--text-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--patch-size", type=int, default=None, help="default: the family's (14 Qwen2.5-VL, 16 Qwen3-VL)")
    p.add_argument("--merge-size", type=int, default=2)
    p.add_argument("--min-pixels", type=int, default=None,
                   help="default: 4 merged tokens' worth (a --preset: the model's own)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="default: 64 merged tokens' worth (a --preset: the model's own)")
    p.add_argument("--tokenizer-vocab", type=int, default=1024)
    from mimo_sft.config.families import family_names
    from mimo_sft.testing.tiny_checkpoint import PRESETS

    # both lists come from the registries, so a new family or preset shows up here by itself
    p.add_argument("--preset", default=None, help="a released architecture instead of the tiny one: "
                   + ", ".join(sorted(PRESETS)))
    p.add_argument("--family", default="qwen2_5_vl",
                   help="the tiny model's family (--model-family name): " + ", ".join(family_names()))
    p.add_argument("--config-only", action="store_true", help="write config and processor, no weights")
    a = p.parse_args(argv)
    from mimo_sft.testing.tiny_checkpoint import write_preset_checkpoint, write_tiny_checkpoint

    if a.preset is not None:
        if a.preset not in PRESETS:
            print(f"error: unknown --preset {a.preset!r}; choose one of {', '.join(sorted(PRESETS))}",
                  file=sys.stderr)
            return 2
        sizes = ("family", "vision_hidden", "vision_depth", "vision_heads", "text_hidden", "text_layers", "heads", "kv_heads",
                 "intermediate", "tie_embeddings", "patch_size", "merge_size", "tokenizer_vocab")
        changed = [opt for opt in sizes if getattr(a, opt) != p.get_default(opt)]
        if changed:
            flags = ", ".join("--" + c.replace("_", "-") for c in changed)
            print(f"error: --preset fixes the architecture; drop {flags}", file=sys.stderr)
            return 2
        try:
            out = write_preset_checkpoint(a.out_dir, a.preset, config_only=a.config_only, seed=a.seed,
                                          min_pixels=a.min_pixels, max_pixels=a.max_pixels)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        what = "config-only" if a.config_only else "random-weight"
        print(f"wrote {what} {a.preset} folder to {out}")
        return 0
    try:
        out = write_tiny_checkpoint(
            a.out_dir, seed=a.seed, vision_hidden=a.vision_hidden, vision_depth=a.vision_depth,
            vision_heads=a.vision_heads, text_hidden=a.text_hidden, text_layers=a.text_layers,
            heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate,
            tie_embeddings=a.tie_embeddings, patch_size=a.patch_size, merge_size=a.merge_size, family=a.family,
            min_pixels=a.min_pixels, max_pixels=a.max_pixels, tokenizer_vocab=a.tokenizer_vocab,
            config_only=a.config_only,
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote tiny {a.family} {'config-only folder' if a.config_only else 'checkpoint'} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
