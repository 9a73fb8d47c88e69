"""Context parallelism in the language model under torchrun (gloo, CPU): each layout's step equals the
single-process step per parameter (``model.context_parallel``)."""

import pytest

from e2e_runs import GROUP_LAYOUTS, PACKED, assert_same_step, layout_run, reference

pytestmark = [pytest.mark.e2e, GROUP_LAYOUTS]


def test_qwen2_5_vl_colocated_cp2_packed():
    got = layout_run("cp2_coloc", 2, ("language=cp=2,dp=1", "images=dp=2"), extra=[*PACKED, "--scalable-dp"])
    assert_same_step(reference(), got, same_flops=False)
