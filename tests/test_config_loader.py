"""YAML + flag loading: overrides, strict keys with suggestions, types."""

import pytest

from mimo_sft.config.loader import dump_config, flag_table, load_config
from mimo_sft.errors import UserError


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return str(p)


def test_flags_override_yaml(tmp_path):
    path = write(tmp_path, "train:\n  micro_batch_size: 8\n  train_iters: 5\ndata:\n  seq_length: 128\n"
                           "parallel:\n  components:\n    language: {dp: 2}\n")
    cfg = load_config(["--config", path, "--train-iters", "7", "--no-pad-to-seq-length", "--lr=3e-4"])
    assert cfg.train.micro_batch_size == 8 and cfg.train.train_iters == 7
    assert cfg.data.seq_length == 128 and cfg.data.pad_to_seq_length is False
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.parallel.components == {"language": {"dp": 2}}


def test_component_flags_replace_yaml_components(tmp_path):
    path = write(tmp_path, "parallel:\n  components:\n    language: {dp: 8}\n    images: {dp: 8}\n")
    cfg = load_config(["--config", path, "--component", "language=dp=2", "--component", "images=dp=2,rank_offset=2"])
    assert set(cfg.parallel.components) == {"language", "images"}
    assert cfg.parallel.components["images"]["rank_offset"] == 2


def test_seed_flag_names_exist():
    names = set(flag_table())
    for flag in ["--hf-model", "--dataset-path", "--seq-length", "--micro-batch-size", "--global-batch-size",
                 "--train-iters", "--dataloader-type", "--pad-to-seq-length", "--scalable-dp",
                 "--intra-microbatch-reorder", "--reorder-encoder-cost-weight", "--reorder-language-cost-weight",
                 "--overlap-intra-microbatch-reorder", "--reorder-window-size", "--load-checkpoint",
                 "--pretrained-checkpoint", "--save", "--save-interval", "--lr", "--seed", "--world-size"]:
        assert flag in names, flag
    cfg = load_config(["--no-overlap-intra-microbatch-reorder"])
    assert cfg.reorder.overlap is False


@pytest.mark.parametrize("yaml_text,needle", [
    ("trian:\n  train_iters: 3\n", "unknown section 'trian' (did you mean 'train'?)"),
    ("train:\n  train_iter: 3\n", "unknown key 'train.train_iter' (did you mean 'train_iters'?)"),
    ("train:\n  train_iters: three\n", "train.train_iters: expected an int"),
    ("data:\n  dataloader_type: random\n", "is not one of single, cyclic"),
    ("reorder:\n  enabled: maybe\n", "reorder.enabled: expected a bool"),
    ("train: [1, 2]\n", "expected a mapping"),
    ("train:\n  train_iters: 1.5\n", "expected an int"),
])
def test_bad_yaml_names_key(tmp_path, yaml_text, needle):
    with pytest.raises(UserError) as e:
        load_config(["--config", write(tmp_path, yaml_text)])
    assert needle in str(e.value)


def test_all_problems_collected(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(["--config", write(tmp_path, "train:\n  train_iter: 3\n  seed: x\nmodle: {}\n")])
    assert len(e.value.problems) == 3


@pytest.mark.parametrize("args,needle", [
    (["--micro-batch-sise", "4"], "did you mean '--micro-batch-size'"),
    (["--seq-length"], "--seq-length needs a value"),
    (["--seq-length", "long"], "--seq-length: expected an int"),
    (["--component", "language=dp=2", "--component", "language=dp=4"], "given twice"),
    (["--config", "/nonexistent.yaml"], "file not found"),
    (["stray"], "unexpected argument"),
])
def test_bad_flags(args, needle):
    with pytest.raises(UserError) as e:
        load_config(args)
    assert needle in str(e.value)


def test_bad_yaml_syntax(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(["--config", write(tmp_path, "train: {a: [}\n")])
    assert "not valid YAML" in str(e.value)


def test_dump_roundtrip(tmp_path):
    cfg = load_config(["--component", "language=dp=2", "--seq-length", "64", "--scalable-dp"])
    again = load_config(["--config", write(tmp_path, dump_config(cfg))])
    assert again == cfg


def test_duplicate_yaml_key_is_refused(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(["--config", write(tmp_path, "train:\n  train_iters: 3\n  train_iters: 5\n")])
    assert "'train_iters' appears twice (line 3)" in str(e.value)
