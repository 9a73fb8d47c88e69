"""Qwen3-VL under torchrun: the non-colocated default layout (language and vision tower on their own
ranks, megatron's bridge moving ``[main | deepstack]`` rows) equals the single-process run in loss,
grad norm, every parameter's reduced gradient and the weights after one step. The other layouts
(fan-in, colocated, tp 2, pp 2, packing, reordering, LoRA) are issue 24 item 2's tests."""

from __future__ import annotations

import functools

import pytest

from test_train_e2e import BASE, assert_same_step
from train_helpers import _TMP, demo_data, new_dir, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dist")]


@functools.lru_cache(maxsize=None)
def qwen3_tiny() -> str:
    from mimo_sft.testing.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(_TMP / "qwen3_tiny", family="qwen3_vl", text_layers=3, seed=0))


def _run(name, nproc, components):
    out = new_dir(name)
    args = ["--hf-model", qwen3_tiny(), "--dataset-path", demo_data(), "--output-dir", out, *BASE,
            "--save-grads", out + "/grads"]
    for c in components:
        args += ["--component", c]
    torchrun(nproc, args)
    return out


def test_non_colocated_deepstack_matches_single_process():
    ref = _run("q3_ref", 1, ["language=dp=1", "images=dp=1"])
    run = _run("q3_nc", 2, ["language=dp=1", "images=dp=1,rank_offset=1"])
    assert_same_step(ref, run)
