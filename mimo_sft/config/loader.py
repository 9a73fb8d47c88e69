"""Load an ExperimentConfig from YAML plus command-line flags (flags win).

Unknown keys, unknown flags and wrong types raise ``UserError`` naming the key or flag and
suggesting the closest valid one. ``--component`` flags, when given, replace the YAML's
``parallel.components`` as a whole: the flags then describe the complete layout.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from mimo_sft.config.schema import SECTIONS, ExperimentConfig
from mimo_sft.errors import UserError
from mimo_sft.parallel.components import parse_component


@dataclass(frozen=True)
class FlagSpec:
    flag: str
    section: str
    name: str
    type: Any  # int, float, str, bool
    optional: bool
    help: str
    choices: tuple | None
    negatable: bool
    repeatable: bool = False  # given several times: a list of values (--dataset-path: a mixture)


def _base_type(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(ExperimentConfig)
    return {name: hints[name] for name in SECTIONS}


def flag_table() -> dict[str, FlagSpec]:
    """Every flag that overrides a config key, generated from the schema's field metadata."""
    table: dict[str, FlagSpec] = {}
    for section, cls in _section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag")
            if not flag:
                continue
            tp, optional = _base_type(hints[f.name])
            table[flag] = FlagSpec(
                flag, section, f.name, tp, optional, f.metadata.get("help", ""), f.metadata.get("choices"),
                bool(f.metadata.get("negatable")) or tp is bool, bool(f.metadata.get("repeatable")),
            )
    return table


EXTRA_FLAGS = {
    "--config": "YAML experiment config; flags override its keys",
    "--component": "NAME=k=v,... module rank group (repeatable); keys tp, pp, cp, dp, etp, rank_offset",
}


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value: Any, tp: Any, optional: bool, where: str, choices: tuple | None = None) -> Any:
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}: must not be empty")
    try:
        if tp is bool:
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                out = True
            elif isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError
        elif tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value) if not isinstance(value, str) else int(value.strip())
        elif tp is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        elif tp is str:
            if isinstance(value, (dict, list, bool)):
                raise ValueError
            out = str(value)
        elif tp is dict:
            if not isinstance(value, dict):
                raise ValueError
            out = value
        elif tp is list:
            if not isinstance(value, list):
                raise ValueError
            out = value
        else:  # pragma: no cover - schema uses only the types above
            out = value
    except (TypeError, ValueError):
        name = getattr(tp, "__name__", str(tp))
        raise UserError(f"{where}: expected {'a' if name != 'int' else 'an'} {name}, got {value!r}") from None
    if choices and out not in choices:
        raise UserError(f"{where}: {out!r} is not one of {', '.join(map(str, choices))}{_suggest(str(out), choices)}")
    return out


def parse_flags(args: list[str]) -> tuple[Optional[str], list[str], dict[tuple[str, str], Any]]:
    """Split ``args`` into (config path, component strings, {(section, key): value})."""
    table = flag_table()
    negations = {"--no-" + f[2:]: spec for f, spec in table.items() if spec.negatable}
    config_path: Optional[str] = None
    components: list[str] = []
    overrides: dict[tuple[str, str], Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; every setting is a --flag (see --help)")
        name, eq, inline = arg.partition("=")

        def take_value() -> str:
            nonlocal i
            if eq:
                return inline
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and not _is_number(args[i + 1])):
                raise UserError(f"{name} needs a value")
            i += 1
            return args[i]

        if name == "--config":
            config_path = take_value()
        elif name == "--component":
            components.append(take_value())
        elif name in table:
            spec = table[name]
            if spec.type is bool and not eq:
                value: Any = True
            else:
                value = take_value()
            value = _coerce(value, spec.type, spec.optional, name, spec.choices)
            key = (spec.section, spec.name)
            if spec.repeatable and key in overrides:  # --dataset-path a --dataset-path b: a mixture
                before = overrides[key]
                value = (before if isinstance(before, list) else [before]) + [value]
            overrides[key] = value
        elif name in negations and not eq:
            spec = negations[name]
            overrides[(spec.section, spec.name)] = False
        else:
            known = list(table) + list(negations) + list(EXTRA_FLAGS)
            raise UserError(f"unknown flag {name}{_suggest(name, known)}; run with --help for the list")
        i += 1
    return config_path, components, overrides


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _build_section(cls: type, raw: Any, section: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{section}: expected a mapping of keys, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = []
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            problems.append(f"unknown key '{section}.{key}'{_suggest(str(key), fields)}")
            continue
        tp, optional = _base_type(hints[key])
        if fields[key].metadata.get("comma_list") and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)  # a YAML list for a comma-separated flag (e.g. model.lora_target_modules)
        try:
            kwargs[key] = _coerce(value, tp, optional, f"{section}.{key}", fields[key].metadata.get("choices"))
        except UserError as e:
            problems.append(str(e))
    if problems:
        raise UserError(problems[0], problems=problems)
    return cls(**kwargs)


def config_from_dict(raw: dict, *, source: str = "config") -> ExperimentConfig:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: the top level must be a mapping with sections {', '.join(SECTIONS)}")
    problems: list[str] = []
    sections = {}
    classes = _section_classes()
    for key in raw:
        if key not in classes:
            problems.append(f"{source}: unknown section '{key}'{_suggest(str(key), SECTIONS)}; sections: {', '.join(SECTIONS)}")
    for name, cls in classes.items():
        try:
            sections[name] = _build_section(cls, raw.get(name), name)
        except UserError as e:
            problems.extend(f"{source}: {p}" for p in e.problems)
    if problems:
        raise UserError(problems[0], problems=problems)
    return ExperimentConfig(**sections)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last silently)."""


def _mapping_without_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise UserError(f"--config {getattr(loader, 'source_path', '')}: key '{key}' appears twice "
                            f"(line {key_node.start_mark.line + 1}); keep one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: file not found")
    try:
        with open(path) as fh:
            loader = _StrictLoader(fh)
            loader.source_path = path
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"--config {path}: not valid YAML{at}; fix the syntax") from None
    return data or {}


def load_config(args: list[str]) -> ExperimentConfig:
    """Resolve YAML (``--config``) plus flag overrides into a typed ExperimentConfig."""
    config_path, components, overrides = parse_flags(args)
    raw: dict = load_yaml(config_path) if config_path else {}
    if not isinstance(raw, dict):
        raise UserError(f"--config {config_path}: the top level must be a mapping of sections")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    given = {(section, key) for section, keys in raw.items() if isinstance(keys, dict) for key in keys}
    given |= set(overrides) | ({("parallel", "components")} if components else set())
    _fold_repeated_paths(raw, overrides)
    for (section, key), value in overrides.items():
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raw[section] = {}
        raw[section][key] = value
    if components:
        specs = {}
        for text in components:
            spec = parse_component(text)
            if spec.name in specs:
                raise UserError(f"--component: module '{spec.name}' is given twice; give each module once")
            specs[spec.name] = spec.to_dict()
        raw.setdefault("parallel", {})
        raw["parallel"]["components"] = specs
    from mimo_sft.config.recorded import take_recorded

    cfg = dataclasses.replace(config_from_dict(raw, source=config_path or "flags"), given=frozenset(given))
    return take_recorded(resolve_calibration(resolve_auto_resume(cfg)))


def resolve_calibration(cfg: ExperimentConfig) -> ExperimentConfig:
    """``--reorder-calibrate-from RUN``: both cost weights from RUN's measured phases (``config.calibration``), the
    folder then dropped and what it gave kept in ``reorder.calibration``: config.yaml and a resumed run hold the
    weights themselves, never a folder whose metrics may have grown since."""
    r = cfg.reorder
    if not r.calibrate_from:
        return cfg
    from mimo_sft.config.calibration import calibrate

    c = calibrate(r.calibrate_from)
    return dataclasses.replace(cfg, reorder=dataclasses.replace(
        r, encoder_cost_weight=1.0, language_cost_weight=float(f"{c.language_weight:.6g}"), calibrate_from=None,
        calibration=c.describe()))


AUTO_RESUME = "auto"


def save_folder(cfg: ExperimentConfig) -> str:
    """Where the run writes its checkpoints: ``--save``, default ``OUTPUT_DIR/checkpoints``."""
    return cfg.checkpoint.save or os.path.join(cfg.logging.output_dir, "checkpoints")


def resolve_auto_resume(cfg: ExperimentConfig) -> ExperimentConfig:
    """``--load-checkpoint auto``: the run's checkpoint folder (:func:`save_folder`) when its ``latest`` names a
    complete checkpoint, else no checkpoint (a fresh start); ``resume_auto`` says it was asked for (the banner
    says which it was)."""
    from mimo_sft.config.checks.checkpoint import find_meta

    c = cfg.checkpoint
    if c.load_checkpoint != AUTO_RESUME:
        return cfg
    folder = save_folder(cfg)
    found = folder if find_meta(folder) is not None else None  # the meta.json its `latest` names
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load_checkpoint=found, resume_auto=True))


def _fold_repeated_paths(raw: dict, overrides: dict) -> None:
    """``--dataset-path`` given several times becomes ``data.datasets`` (one entry per path, in flag
    order), replacing the YAML's sources as a whole (as ``--component`` replaces the layout); a
    ``--valid-dataset-path`` given several times names each source's validation set. Edits both."""
    paths = overrides.get(("data", "dataset_path"))
    valids = overrides.get(("data", "valid_dataset_path"))
    data = raw.setdefault("data", {}) if isinstance(raw.get("data", {}), dict) else {}
    raw["data"] = data
    if isinstance(paths, list):
        data["datasets"] = [{"path": p} for p in paths]
        data.pop("dataset_path", None)
        overrides[("data", "dataset_path")] = None
    elif paths is not None and data.get("datasets"):
        data["datasets"] = []  # one --dataset-path replaces the YAML's mixture
    if isinstance(valids, list):
        entries = data.get("datasets") or []
        if len(valids) != len(entries):
            raise UserError(f"--valid-dataset-path is given {len(valids)} times for {len(entries)} training sources; "
                            "give it once (one validation set) or once per source, in the order of the sources")
        data["datasets"] = [dict(e, valid_path=v) if isinstance(e, dict) else e for e, v in zip(entries, valids)]
        overrides[("data", "valid_dataset_path")] = None


def config_to_dict(cfg: ExperimentConfig) -> dict:
    """The config's sections (config.yaml, the trackers' config), without which keys were given."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
