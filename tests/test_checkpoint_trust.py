"""A checkpoint is data: every file a load reads is read without running its author's code
(``train.checkpoint.trusted``).

Each test plants a payload (a ``__reduce__`` that runs ``touch MARKER``) in one file a load reads -- a part's
``.metadata``, a stored object in a ``.distcp`` file, a rank's RNG file -- keeping the file loadable by a plain
unpickler, so the old readers ran it and went on training. Every path that reads a checkpoint must refuse it:
no marker, exit 2, one line naming the file and the class, no traceback. The checkpoints are the never-stopped
run's (1 rank; the LoRA and MoE checkpoints are tried in test_lora_e2e.py and test_moe_e2e.py).
"""

import io
import os
import pickle
import pickletools

import numpy as np
import pytest
import torch

from checkpoint_payloads import PLANTS, Payload, assert_refused, copy_checkpoint, planted
from e2e_runs import GROUP_STOP, never_stopped, stop_args
from train_helpers import demo_data, metrics, new_dir, python_m, tiny_model

from mimo_sft.errors import UserError
from mimo_sft.train.checkpoint import trusted

pytestmark = [pytest.mark.e2e, GROUP_STOP]


def _ckpt(step: int = 4) -> str:
    return os.path.join(never_stopped(), "checkpoints", f"iter_{step:07d}")


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_planted_files_run_their_payload_under_a_plain_load_and_are_refused_by_checkpoint_info(kind, tmp_path):
    """The control (a plain load of the planted file runs the payload, so the refusals below could fail),
    then ``checkpoint info --verify`` refuses it, and ``checkpoint info`` too where it reads the file."""
    folder, marker, refused = planted(_ckpt(), tmp_path, kind)
    _plain_load(kind, refused)
    assert os.path.exists(marker)
    os.remove(marker)
    assert_refused(python_m(["checkpoint", "info", "--verify", folder]), refused, marker)
    if kind.endswith("metadata"):  # the sizes per module come from both parts' metadata
        assert_refused(python_m(["checkpoint", "info", folder]), refused, marker)


def _plain_load(kind: str, refused: str) -> None:
    """What mimo-sft's readers did before: ``pickle.load`` (torch's ``FileSystemReader.read_metadata``),
    ``torch.load(weights_only=False)`` (the rank file; a stored object, as ``DefaultLoadPlanner.load_bytes``)."""
    if kind.endswith("metadata"):
        with open(refused, "rb") as fh:
            pickle.load(fh)
    elif kind == "rank_file":
        torch.load(refused, weights_only=False)
    else:
        with open(os.path.join(os.path.dirname(refused), ".metadata"), "rb") as fh:
            metadata = pickle.load(fh)
        end = os.path.getsize(refused)
        info = next(i for i in metadata.storage_data.values() if i.offset + i.length == end)
        with open(refused, "rb") as fh:
            fh.seek(info.offset)
            torch.load(io.BytesIO(fh.read(info.length)), weights_only=False)


def test_checkpoint_info_verify_checks_a_clean_checkpoint_and_names_a_truncated_file(tmp_path):
    proc = python_m(["checkpoint", "info", "--verify", _ckpt()])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verified: 2 parts, 2 data files (sizes)" in proc.stdout and "1 rank files" in proc.stdout, proc.stdout
    folder = copy_checkpoint(_ckpt(), str(tmp_path / "truncated"))
    data = folder + "/model/__0_0.distcp"
    os.truncate(data, os.path.getsize(data) - 10)
    proc = python_m(["checkpoint", "info", "--verify", folder])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and f"{data} holds" in proc.stderr
    assert "the checkpoint is truncated" in proc.stderr


def _run(out: str, *flags: str):
    """One rank without torchrun (its own exit code): the never-stopped run's flags."""
    return python_m(["finetune", *stop_args(6), "--output-dir", out, "--no-save", *flags])


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_resume_refuses_each_planted_file_before_reading_anything(kind, tmp_path):
    folder, marker, refused = planted(_ckpt(), tmp_path, kind)
    assert_refused(_run(new_dir(f"trust_resume_{kind}"), "--load-checkpoint", folder), refused, marker)


def test_pretrained_checkpoint_evaluate_and_export_refuse_a_planted_model_metadata(tmp_path):
    folder, marker, refused = planted(_ckpt(), tmp_path, "model_metadata")
    assert_refused(_run(new_dir("trust_pretrained"), "--pretrained-checkpoint", folder), refused, marker)
    evaluate = ["evaluate", folder, "--dataset-path", demo_data(), "--seq-length", "160", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--component", "language=dp=1", "--component", "images=dp=1"]
    assert_refused(python_m(evaluate), refused, marker)
    assert_refused(python_m(["export", "--checkpoint", folder, "--out", str(tmp_path / "hf")]), refused, marker)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def _old_form(rank_file: str) -> None:
    """The rank file as mimo-sft wrote it before this change: numpy's RNG key as an array."""
    state = torch.load(rank_file, weights_only=True)
    kind, key, *rest = state["rng"]["numpy"]
    state["rng"]["numpy"] = (kind, np.asarray(key, dtype=np.uint32), *rest)
    torch.save(state, rank_file)


def _written_on_a_gpu(rank_file: str) -> None:
    """The rank file as a GPU rank writes it: CUDA's generator and megatron's tracker hold Philox states."""
    state = torch.load(rank_file, weights_only=False)
    state.pop("device", None)  # files from before the device was recorded: told by the CUDA state they hold
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)
    state["rng"]["tracker"] = {name: torch.zeros(16, dtype=torch.uint8) for name in state["rng"]["tracker"]}
    torch.save(state, rank_file)


def _globals(path: str) -> set[str]:
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    names, strings = set(), []
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            names.add(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
    return names


def test_rank_files_hold_no_numpy_object_and_one_written_before_this_change_resumes_exactly(tmp_path):
    """Rank files are written with no class outside torch's weights-only set, and record their device; a rank
    file in the older form (numpy's key as an array: three numpy globals, admitted by name) still resumes, bit for
    bit -- here also written on a GPU (a CUDA generator and Philox tracker states, which the CPU cannot take): the
    device's streams restart from the seed and step, said in one line, and the run, which draws nothing from
    them (no dropout), goes on exactly."""
    rank_file = _ckpt() + "/rank_00000.pt"
    assert not any(g.startswith("numpy") for g in _globals(rank_file)), _globals(rank_file)
    assert torch.load(rank_file, weights_only=True)["device"] == "cpu"  # no allow-list needed
    folder = copy_checkpoint(_ckpt(), str(tmp_path / "old_form"))
    _old_form(folder + "/rank_00000.pt")
    _written_on_a_gpu(folder + "/rank_00000.pt")
    assert any(g.startswith("numpy") for g in _globals(folder + "/rank_00000.pt"))
    out = new_dir("trust_old_rank_file")
    proc = _run(out, "--load-checkpoint", folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint written on cuda, resumed on cpu: the device's random streams" in proc.stdout, proc.stdout
    a = {m["step"]: m for m in metrics(never_stopped())}
    b = {m["step"]: m for m in metrics(out)}
    assert sorted(b) == [5, 6] and all(b[s]["loss"] == a[s]["loss"] and b[s]["grad_norm"] == a[s]["grad_norm"]
                                       for s in b), (a, b)


# ---- the restricted unpickler itself (no processes) ------------------------------------------------------------

@pytest.mark.parametrize("payload", [
    b"cos\nsystem\n(S'touch X'\ntR.",                                # protocol 0 GLOBAL + REDUCE
    b"(cos\nsystem\nS'touch X'\ni.",                                 # INST
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04eval\x93\x8c\x01X\x85R.",  # STACK_GLOBAL
    b"\x80\x02ctorch\nload\nq\x00.",                                 # a torch function that is not a dtype
    b"\x80\x02ctorch.distributed.checkpoint.metadata\nos\nq\x00.",    # a module's import, by attribute
])
def test_restricted_unpickler_refuses_every_way_to_name_a_callable(payload, tmp_path):
    part = tmp_path / "model"
    part.mkdir()
    (part / ".metadata").write_bytes(payload)
    with pytest.raises(UserError) as err:
        trusted.read_metadata(str(part))
    assert "refused to load" in str(err.value) and str(part / ".metadata") in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_restricted_unpickler_reads_torch_metadata_and_refuses_other_data(tmp_path):
    md = trusted.read_metadata(_ckpt() + "/optimizer")
    assert md.state_dict_metadata and md.storage_data
    part = tmp_path / "p"
    part.mkdir()
    (part / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UserError, match="not torch distributed-checkpoint metadata"):
        trusted.read_metadata(str(part))
    (part / ".metadata").write_bytes(pickle.dumps(md)[:100])
    with pytest.raises(UserError, match="cannot be read .* the checkpoint is damaged"):
        trusted.read_metadata(str(part))


def test_a_hugging_face_folder_with_only_pickled_weights_is_refused(tmp_path):
    import shutil

    from mimo_sft.model.hf_checkpoint import HFCheckpoint

    folder = tmp_path / "hf"
    shutil.copytree(tiny_model(), folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(str(tmp_path / "ran"))))
    with pytest.raises(UserError, match=r"holds its weights only as pickles \(pytorch_model.bin\)") as err:
        HFCheckpoint(str(folder))
    assert "safetensors" in str(err.value) and not (tmp_path / "ran").exists()
