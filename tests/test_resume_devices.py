"""A checkpoint resumed on another kind of device (``parallel.runtime.restore_rng``).

A rank file records the device type it was written on. Resumed on the same kind, every RNG stream comes back as
it was. On another kind, the device's streams -- megatron's tracker (dropout, LoRA dropout) and the CUDA
generator -- cannot: a CPU generator's state put into CUDA's is "RNG state is wrong size" at the first
``fork()``. They are seeded from the run's seed and step instead, and the host's streams carry over.

* A GPU-written rank state (CUDA-sized tracker states) resumes on the CPU: reseeded, said in one line, and the
  tracker forks (a dropout draw) where setting the saved states fails as the first GPU resume would have.
* A CPU-written one resumes on the device audit's stand-in device (another kind, as a GPU is): reseeded, and a
  forked draw on the device mixes nothing with the host.
* The same kind restores the saved streams exactly. (A real checkpoint's rank file records its device, and a
  GPU-written one resumes a CPU run exactly: ``tests/test_checkpoint_trust.py``.)
"""

from __future__ import annotations

import random

import pytest
import torch

from dist_utils import run_distributed


def _gpu_written_state(seed: int = 3) -> dict:
    """What a GPU rank writes: host streams, a CUDA generator state and tracker states (16 bytes: Philox)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    philox = torch.zeros(16, dtype=torch.uint8)
    return {"device": "cuda", "rng": {"python": random.getstate(), "numpy": (kind, key.tolist(), pos, has_gauss, gauss),
                                      "torch": torch.get_rng_state(), "cuda": philox,
                                      "tracker": {"model-parallel-rng": philox.clone()}}}


def gpu_state_on_this_device(rank: int, world: int) -> dict:
    from megatron.core import tensor_parallel

    from mimo_sft.parallel import runtime

    runtime.init_megatron(0, tp_rank=0)
    state = _gpu_written_state()
    with pytest.raises(RuntimeError, match="wrong size|size"):  # what the first GPU resume met, the other way round
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        with tensor_parallel.get_cuda_rng_tracker().fork():
            torch.rand(2)
    runtime.init_megatron(0, tp_rank=0)
    said = runtime.restore_rng(state, seed=7, step=5, ranks={"tp_rank": 0, "ep_rank": 0, "etp_rank": 0})
    host_draw = random.random()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    runtime.restore_rng(state, seed=7, step=5, ranks={"tp_rank": 0, "ep_rank": 0, "etp_rank": 0})
    random.random()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    random.setstate(state["rng"]["python"])
    return {"said": said, "host_carried": host_draw == random.random(), "reseeded_alike": torch.equal(first, again)}


def test_a_gpu_checkpoint_resumes_on_the_cpu():
    (r,) = run_distributed(gpu_state_on_this_device, 1)
    assert r["said"] is not None and r["said"].startswith("checkpoint written on cuda, resumed on cpu")
    assert "step 5" in r["said"] and r["host_carried"] and r["reseeded_alike"], r


def cpu_state_on_the_stand_in(rank: int, world: int) -> dict:
    from megatron.core import tensor_parallel

    from mimo_sft.parallel import runtime
    from mimo_sft.testing.device_audit import STANDIN_DEVICE, DeviceAudit, on_device

    state = _gpu_written_state()
    state["rng"].pop("cuda")
    state["device"] = "cpu"
    state["rng"]["tracker"] = {"model-parallel-rng": torch.get_rng_state()}  # a CPU generator's (5056 bytes)
    with DeviceAudit() as audit:
        runtime.init_megatron(0, tp_rank=0)
        said = runtime.restore_rng(state, seed=7, step=5, ranks={"tp_rank": 0, "ep_rank": 0, "etp_rank": 0})
        with tensor_parallel.get_cuda_rng_tracker().fork():
            mask = torch.nn.functional.dropout(torch.ones(8, device=STANDIN_DEVICE), 0.5)
        findings = [f"{f.kind} {f.op} {f.site}" for f in audit.log.findings]
    return {"said": said, "device": runtime.device().type, "on_device": on_device(mask), "findings": findings}


cpu_state_on_the_stand_in.on_standin_device = True


def test_a_cpu_checkpoint_resumes_on_another_kind_of_device():
    (r,) = run_distributed(cpu_state_on_the_stand_in, 1)
    assert r["device"] == "meta" and r["on_device"], r
    assert r["said"] is not None and r["said"].startswith("checkpoint written on cpu, resumed on meta"), r
    assert not r["findings"], r["findings"]


def same_kind(rank: int, world: int) -> dict:
    from megatron.core import tensor_parallel

    from mimo_sft.parallel import runtime

    runtime.init_megatron(11, tp_rank=0)
    saved = {"rng": runtime.rng_state(), "device": runtime.device().type}
    with tensor_parallel.get_cuda_rng_tracker().fork():
        want = torch.rand(4)
    runtime.init_megatron(12, tp_rank=0)  # other streams
    said = runtime.restore_rng(saved, seed=99, step=1, ranks={"tp_rank": 0, "ep_rank": 0, "etp_rank": 0})
    with tensor_parallel.get_cuda_rng_tracker().fork():
        got = torch.rand(4)
    return {"said": said, "equal": torch.equal(want, got)}


def test_the_same_kind_of_device_restores_every_stream():
    from mimo_sft.parallel.runtime import saved_device_type

    (r,) = run_distributed(same_kind, 1)
    assert r == {"said": None, "equal": True}
    assert saved_device_type({"rng": {"cuda": b""}}) == "cuda" and saved_device_type({"rng": {}}) == "cpu"
    assert saved_device_type({"rng": {}, "device": "meta"}) == "meta"
