"""The preloaded parent ("zygote") behind ``tests/preloaded.py``: import once, fork every run.

Why: each rank of a test's ``torchrun`` spends about 6 s of CPU importing torch, megatron-core,
transformers and datasets before it does anything, and torchrun itself about 1 s more. This process
imports all of it once -- without running a torch op or starting a thread of its own -- and then
serves requests from the one pytest process that started it: for each request it forks a
*supervisor* in a session of its own, which forks the ranks (see ``preloaded_ranks``). A rank is
then a copy of an interpreter that has already imported everything a finetune imports.

What stays exact and what is checked instead:

* every environment variable a run passes reaches its ranks (``os.environ`` is replaced in each
  rank before the command runs); a variable that a preloaded module already *read at import* would
  be frozen at this process's value, so the keys read while importing are recorded
  (:class:`EnvReads`) and sent to the client, which uses real torchrun for a run whose value of any
  of them differs (``preloaded.frozen_mismatch``);
* the environment a real rank has while it imports is reproduced first: the test run defaults
  (``RUN_ENV``) and what ``mimo_sft.cli.main`` / ``quiet_libraries`` set before their heavy imports
  (``CLI_ENV_DEFAULTS``).

Protocol: one ``SOCK_SEQPACKET`` socket (a JSON object per packet; the output files travel as file
descriptors with the request); see ``preloaded.Zygote``. Only the standard library is imported at
the top: the heavy imports happen in :func:`preload`.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import sys
import traceback

#: what every test run's environment holds (``train_helpers`` passes it to real torchrun too)
RUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
#: set (setdefault) by ``mimo_sft.cli.main`` and ``mimo_sft.quiet.quiet_libraries`` before the heavy
#: imports of a real run (datasets and huggingface_hub read them at import); conftest sets them too
CLI_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
#: imported first: the heavy libraries (``mimo_sft.parallel`` makes ``megatron.core`` importable)
BASE_MODULES = ["torch", "torch.distributed", "mimo_sft.parallel", "megatron.core", "transformers", "datasets"]
#: what a finetune imports lazily besides ``mimo_sft``'s own modules (every one of those is imported:
#: ``pkgutil.walk_packages``); from a finetune's ``sys.modules`` at exit minus this preload's
EXTRA_MODULES = [
    "megatron.core.models.gpt.gpt_model", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.transformer_block", "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention", "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.extensions.transformer_engine_spec_provider",
    "megatron.core.fusions.fused_bias_dropout", "megatron.core.fusions.fused_cross_entropy",
    "megatron.core.fusions.fused_layer_norm", "megatron.core.fusions.fused_softmax", "megatron.core.recompute",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
    "transformers.models.qwen2.tokenization_qwen2", "multiprocessing.managers", "multiprocessing.popen_fork",
    "multiprocessing.popen_spawn_posix", "multiprocessing.shared_memory", "torch.utils.serialization",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.format_utils", "safetensors.torch",
    "PIL.Image", "pyarrow.parquet", "pydantic.type_adapter", "typer._adapters",
]
#: modules that scan the whole environment at import for keys with these prefixes (tqdm, networkx, fsspec)
SCANNED_PREFIXES = ("TQDM_", "NETWORKX_", "FSSPEC_")
MAX_PACKET = 1 << 20


class EnvReads:
    """Record the environment keys read (``os.environ[k]``, ``.get``, ``in``, ``os.getenv``) while
    the preload imports run, and where the whole environment was scanned. Values read through an
    items()/values() scan do not count as reads of their key (see :data:`SCANNED_PREFIXES`)."""

    def __enter__(self):
        self.keys: set[str] = set()
        self.scans: list[str] = []
        cls = os._Environ
        self._saved = cls.__getitem__, cls.__iter__
        get, iterate = self._saved
        keys, scans = self.keys, self.scans

        def getitem(env, key):
            caller = sys._getframe(1).f_code
            if not (caller.co_name == "__iter__" and "_collections_abc" in caller.co_filename):
                keys.add(key.decode() if isinstance(key, bytes) else key)
            return get(env, key)

        def scan(env):
            f = sys._getframe(1)
            while f is not None and "_collections_abc" in f.f_code.co_filename:
                f = f.f_back
            scans.append(f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?")
            return iterate(env)

        cls.__getitem__, cls.__iter__ = getitem, scan
        return self

    def __exit__(self, *exc):
        os._Environ.__getitem__, os._Environ.__iter__ = self._saved
        return False


def _import(name: str, errors: list[str]) -> None:
    try:
        importlib.import_module(name)
    except Exception as e:  # a module being moved, an optional extra: the rank imports what it needs itself
        errors.append(f"{name}: {type(e).__name__}: {e}")


def preload() -> dict:
    """Import what a rank imports. Returns what the client needs to know about it: ``env`` (the
    environment the imports saw), ``set_by_imports`` (variables the imports set or removed: None;
    a real rank has them from its own imports, so each forked rank gets them too), ``frozen`` (the
    keys the imports read), ``errors`` (imports that failed) and ``scans`` (whole-environment reads)."""
    for key, value in {**RUN_ENV, **CLI_ENV_DEFAULTS}.items():
        os.environ.setdefault(key, value)
    seen = dict(os.environ)
    errors: list[str] = []
    with EnvReads() as reads:
        for name in BASE_MODULES:
            _import(name, errors)
        import mimo_sft

        for info in pkgutil.walk_packages(mimo_sft.__path__, "mimo_sft.", onerror=lambda n: errors.append(n)):
            if info.name.rsplit(".", 1)[-1] != "__main__":
                _import(info.name, errors)
        for name in EXTRA_MODULES:
            _import(name, errors)
    now = dict(os.environ)
    changed = {k: now.get(k) for k in set(now) | set(seen) if now.get(k) != seen.get(k)}
    return {"env": seen, "set_by_imports": changed, "frozen": sorted(reads.keys | set(changed)),
            "errors": errors, "scans": reads.scans}


def thread_names() -> list[str]:
    """Names of this process's native threads, the main thread's first (a fork copies only the calling one).
    Task ids sort as numbers with the main one (the pid) first: as strings, a later thread whose id has one
    more digit than the pid would sort before it."""
    names = []
    pid = os.getpid()
    for tid in sorted(os.listdir("/proc/self/task"), key=lambda t: (int(t) != pid, int(t))):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            continue
    return names


def send(sock: socket.socket, msg: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def exit_code(status: int) -> int:
    """A wait status as ``subprocess`` reports it: the exit code, or -N for a death by signal N."""
    return os.waitstatus_to_exitcode(status)


def serve(sock: socket.socket, set_by_imports: dict) -> None:
    """Fork a supervisor per request; report its pid, then its exit code. A closed socket (the
    client is gone) ends this process and every run still going (their sessions are killed)."""
    from preloaded_ranks import start_supervisor

    running: dict[int, int] = {}  # supervisor pid -> request id
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05 if running else None)
        if ready:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET, 8)
            if not data:
                for pid in running:
                    _kill_group(pid)
                return
            req = json.loads(data)
            try:
                pid = start_supervisor(dict(req, set_by_imports=set_by_imports), fds, sock)
            except Exception:
                send(sock, {"id": req["id"], "error": traceback.format_exc()})
                pid = None
            finally:
                for fd in fds:
                    os.close(fd)
            if pid is not None:
                running[pid] = req["id"]
                send(sock, {"id": req["id"], "pid": pid})
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in running:  # cpu: the supervisor's and its ranks' (it waited for them)
                send(sock, {"id": running.pop(pid), "exit": exit_code(status),
                            "cpu_s": usage.ru_utime + usage.ru_stime})


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sys.stdin.close()
    state = preload()
    # what the imports allocated stays out of every rank's garbage collections (which would touch,
    # and so copy, all of those pages): the recipe of the gc module's documentation for a forking parent
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    send(sock, {"ready": True, "pid": os.getpid(), "threads": thread_names(), **state})
    serve(sock, state["set_by_imports"])


if __name__ == "__main__":
    main(int(sys.argv[1]))
