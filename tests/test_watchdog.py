"""The hang watchdog (issue 45 item 1, ``train.watchdog``): a rank stopped on purpose (a fault hook only tests
set) ends the run within --hang-timeout plus 30 s, with one line naming the stuck rank and where the others wait,
every rank's stack in OUTPUT_DIR/hang/, and exit code 75 (requeue). The naming rule is tested without processes."""

import os
import re
import time

import pytest

from train_helpers import demo_data, new_dir, python_m, tiny_model

from mimo_sft.config.loader import load_config
from mimo_sft.train.watchdog import HANG_EXIT_CODE, behind, hang_timeout_s, report_line
from mimo_sft.validate import check_config


def _beat(rank, step, phase, published=100.0):
    return {"rank": rank, "host": "h", "step": step, "microbatch": 1, "phase": phase, "published": published}


def test_the_stuck_rank_is_the_one_the_others_wait_for():
    now = 110.0
    # same step: the rank in its own data wait holds up the one in the bridge
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "data wait")}, now, 30)[:2] == ([1], [])
    # an earlier step is behind whatever its phase
    assert behind({0: _beat(0, 3, "gradient finalize"), 1: _beat(1, 2, "bridge"), 2: _beat(2, 3, "bridge")},
                  now, 30)[:2] == ([1], [])
    # a rank that stopped publishing is frozen or dead
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "bridge", published=10.0)}, now, 30)[:2] == ([], [1])
    # everyone in the same collective: nobody to name
    assert behind({0: _beat(0, 2, "bridge"), 1: _beat(1, 2, "gradient finalize")}, now, 30) == ([], [], None)
    stuck, _, waiting = behind({0: _beat(0, 2, "gradient finalize"), 1: _beat(1, 2, "compute after data wait")}, now, 30)
    assert stuck == [1] and waiting["rank"] == 0


def test_the_timeout_in_force_and_its_checks():
    assert hang_timeout_s(0, [1.0] * 9, 600) == float("inf")
    assert hang_timeout_s(10, [0.1] * 3, 600) == 10  # explicit, after the first step
    assert hang_timeout_s(10, [], 600) == 540  # the first step (warm-up) gets the default's floor
    assert hang_timeout_s(-1, [0.1] * 9, 1800) == 600 and hang_timeout_s(-1, [60.0] * 9, 1800) == 1200
    assert hang_timeout_s(-1, [0.1] * 9, 300) == 240  # never closer than a minute to --dist-timeout
    for flags, says in ((["--hang-timeout", "590"], "not shorter than --dist-timeout 600 by 30 s"),
                        (["--hang-timeout", "-5"], "must be >= 1 seconds (or 0: no watchdog)")):
        problems = [p.message for p in check_config(load_config(flags)).problems]
        assert any(says in p for p in problems), problems
    assert not [p for p in check_config(load_config(["--hang-timeout", "60"])).problems if "hang" in p.message]


#: per layout: components, ranks, and what the line says rank 1 never reached (the others' collective, its peers)
HANG_LAYOUTS = {
    "non_colocated": (["language=dp=1", "images=dp=1,rank_offset=1"], 2,
                      # (the bridge's shape exchange, first of each transfer, runs on its gloo twin: host values)
                      "batch_isend_irecv (from rank 1) on bridge images->language shapes (host) (ranks 0,1) that rank(s) 0 "
                      "wait in"),
    # the distributed optimizer's parameter all-gather, which rank 0's forward waits for
    "colocated": (["language=dp=2", "images=dp=2"], 2,
                  "all_gather_into_tensor on language dp-cp (ranks 0,1) that rank(s) 0 wait in"),
    # tests/e2e_runs.py PP2: rank 1 is the last language stage; stage 0 waits in its send/recv to it
    "pp2": (["language=pp=2,dp=1", "images=dp=1,rank_offset=2"], 3,
            "batch_isend_irecv (to rank 1, from rank 1) on language pp (ranks 0,1) that rank(s) 0 wait in"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(HANG_LAYOUTS))
def test_a_stuck_rank_is_named_dumped_and_the_run_exits_75(layout):
    components, nproc, collective = HANG_LAYOUTS[layout]
    out = new_dir(f"hang_{layout}")
    args = ["finetune", "--nproc-per-node", str(nproc), "--hf-model", tiny_model(), "--dataset-path", demo_data(),
            "--seq-length", "160", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--no-save", "--no-tensorboard", "--output-dir", out, "--hang-timeout", "10", "--dist-timeout", "120",
            *[a for c in components for a in ("--component", c)]]
    proc = python_m(args, real=True, env={**os.environ, "MIMO_SFT_TEST_HANG_AT": "1:2"}, timeout=300)
    ended = time.time()
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rank 1 (" in errors[0] and f"never reached {collective}; it is in data wait of step 2" in errors[0], errors
    dumps = {r: os.path.join(out, "hang", f"rank_{r}.txt") for r in range(nproc)}
    text = {r: open(path).read() for r, path in dumps.items()}
    assert "phase: data wait" in text[1] and "in enter" in text[1] and "time.sleep(3600)" in text[1]
    for r in range(nproc):  # each rank: where it is, its last collective, its stack with the training thread first
        assert f"rank {r} on " in text[r] and "step 2" in text[r] and "\n  MainThread: #" in text[r], text[r][:2000]
        assert text[r].index("--- thread MainThread ---") < text[r].index("--- thread mimo-sft-watchdog ---")
    waiter = collective.split(" that ")[0]
    assert "MainThread: #" in text[0] and waiter.split(" on ")[0] in text[0] and "wait()" in text[0], text[0][:3000]
    if layout == "pp2":  # the encoder rank waits too, in its bridge to stage 0
        assert "rank(s) 2 wait for them in " in errors[0] and "on bridge images->language shapes (host) (ranks 0,2)" in text[2]
    # within --hang-timeout + 30 s of the moment rank 1 stopped (its dump says how long before it was written)
    idle = float(re.search(r"no progress for ([\d.]+) s", text[1]).group(1))
    stopped = os.path.getmtime(dumps[1]) - idle
    assert ended - stopped < 10 + 30, ended - stopped


def test_inside_its_own_phase_is_more_suspect_than_computing_after_one():
    """Colocated: the peer of a rank stuck in its data wait waits in a parameter gather no phase names."""
    stuck, _, waiting = behind({0: _beat(0, 2, "compute after data wait"), 1: _beat(1, 2, "data wait")}, 110.0, 30)
    assert stuck == [1] and waiting["rank"] == 0


def _coll(text_op, ranks, *, peers=(), group="language pp", state="in"):
    peers = [list(p) for p in peers]
    text = text_op + (" (" + ", ".join(f"{d} rank {r}" for d, r in peers) + ")" if peers else "")
    return {"seq": 7, "op": text_op, "group": group, "ranks": list(ranks), "peers": peers, "state": state,
            "text": f"{text} on {group} (ranks {','.join(map(str, ranks))})"}


def test_the_line_names_the_collective_the_others_wait_in():
    now = 110.0
    beats = {0: {**_beat(0, 2, "bridge"), "collective": _coll("batch_isend_irecv", (0, 1), peers=[("to", 1)],
                                                                state="issued")},
             1: {**_beat(1, 2, "data wait"), "collective": _coll("all_reduce", (0, 1, 2), group="world gloo",
                                                                 state="returned"),
                 "loader": ["MainThread waits for worker 0 (pid 42, alive, not delivering) of the DataLoader over X"]},
             2: {**_beat(2, 2, "bridge"), "collective": _coll("recv", (0, 2), peers=[("from", 0)],
                                                               group="bridge images->language")}}
    line = report_line(beats, now, 30, 3, "/out/hang")
    assert ("rank 1 (h) never reached batch_isend_irecv (to rank 1) on language pp (ranks 0,1) that rank(s) 0 wait "
            "in; it is in data wait of step 2 (micro-batch 1): the data loader is stuck (MainThread waits for worker "
            "0 (pid 42") in line, line
    assert "its last collective: all_reduce on world gloo (ranks 0,1,2) (returned)" in line
    # rank 2 waits on rank 0 (not a peer of rank 1): named as waiting, with where it is
    assert ("rank(s) 2 wait for them in bridge of step 2 (recv (from rank 0) on bridge images->language (ranks 0,2), "
            "in)") in line and line.count("error:") == 1
    # a collective a waiting rank has returned from is not one it waits in
    beats[0]["collective"]["state"] = "returned"
    assert "never reached" not in report_line(beats, now, 30, 3, "/out/hang")
    # a frozen rank: named with the collective its peers wait in
    beats[0]["collective"]["state"] = "in"
    beats[1]["published"] = 10.0
    line = report_line(beats, now, 30, 3, "/out/hang")
    assert "rank 1 (h) never reached batch_isend_irecv (to rank 1)" in line and "stopped publishing" in line


def test_the_recorder_names_op_group_and_peer_and_sees_megatrons_bound_aliases():
    import threading

    import torch
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from mimo_sft.parallel import collectives
    from mimo_sft.parallel.bootstrap import start_single_process

    state = start_single_process("cpu")
    collectives.install()
    collectives.install()  # idempotent: wrapped once
    assert dist.all_reduce.__wrapped__ is dist.distributed_c10d.all_reduce
    assert pgb.dist_reduce_scatter_func is dist.reduce_scatter_tensor  # bound at megatron's import, rebound
    me = threading.get_ident()
    group = state.modules["language"].dp_gloo
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    c = collectives.last_of(me)
    assert (c["op"], c["group"], c["ranks"], c["state"]) == ("all_reduce", "language dp gloo", [0], "returned")
    dist.broadcast(t, 0, group)  # positional src and group
    c = collectives.last_of(me)
    assert c["text"] == "broadcast (from rank 0) on language dp gloo (ranks 0)" and c["seq"] > 1
    dist.all_reduce(t, async_op=True).wait()
    assert collectives.last_of(me)["state"] == "issued" and collectives.last_of(me)["group"] == "world"
    assert torch.equal(t, torch.ones(3))  # the calls did their work
    # torch's P2POp takes only the original isend/irecv: they stay unwrapped (the module docstring says so)
    assert dist.P2POp(dist.isend, t, 0).op is dist.distributed_c10d.isend


def test_a_stalled_or_killed_loader_worker_is_named(tmp_path):
    """Real DataLoaders: a worker that stalls is named from the reading thread's stack; a killed one from torch's
    error, whether the reading thread notices (a thread of its own: reorder, index planning) or torch's SIGCHLD
    handler does (an iterator made on the main thread)."""
    import signal
    import threading

    import torch

    from mimo_sft.data.loader_workers import waiting_on, worker_failure

    class Stalls(torch.utils.data.Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            time.sleep(3600 if i == 3 else 0.05)
            return i

    box = {}

    def read():
        box["it"] = iter(torch.utils.data.DataLoader(Stalls(), batch_size=None, num_workers=2, prefetch_factor=1))
        try:
            for _ in range(10):
                next(box["it"])
        except RuntimeError as e:
            box["error"] = e

    reader = threading.Thread(target=read, name="reader", daemon=True)
    reader.start()
    deadline, found = time.monotonic() + 60, []
    while time.monotonic() < deadline and not found:
        time.sleep(0.5)
        found = [w for w in waiting_on() if w["thread"] == "reader" and w["worker"] is not None]
    it = box["it"]
    assert found and found[0]["worker"] == 1 and found[0]["alive"], found  # item 3 went to worker 1 (round robin)
    assert found[0]["pid"] == it._workers[1].pid and "of the DataLoader over Stalls" in found[0]["text"]
    # the heartbeat of a rank in its data wait carries it, and so does its dump
    from mimo_sft.progress import PROGRESS
    from mimo_sft.train.watchdog import Watchdog

    dog = Watchdog(output_dir=str(tmp_path), rank=0, world_size=1, store=None, setting=0, dist_timeout_s=600)
    saved, PROGRESS.phase = PROGRESS.phase, "data wait"
    try:
        beat, dump = dog._beat(), open(dog.dump(10)).read()
    finally:
        PROGRESS.phase = saved
    assert beat["loader"] == [found[0]["text"]] and f"data loader: {found[0]['text']}" in dump
    os.kill(it._workers[1].pid, signal.SIGKILL)  # torch checks its workers every 5 s while it waits
    reader.join(60)
    line = worker_failure(box["error"])
    assert line.startswith("data loader: worker 1 (pid ") and "of the DataLoader over Stalls was killed by SIGKILL" in line
    it._shutdown_workers()

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            time.sleep(0.1)
            return i

    it = iter(torch.utils.data.DataLoader(Slow(), batch_size=None, num_workers=2))
    next(it)
    err = None
    try:
        os.kill(it._workers[0].pid, signal.SIGKILL)
        for _ in range(20):
            next(it)
            time.sleep(0.1)
    except RuntimeError as e:
        err = e
    line = worker_failure(err)
    assert line.startswith("data loader: worker 0 (pid ") and "of the DataLoader over Slow was killed by SIGKILL" in line
    assert worker_failure(RuntimeError("Connection closed by peer")) is None
    it._shutdown_workers()


def test_a_dead_loader_worker_ends_the_rank_in_one_line(monkeypatch, capsys):
    from types import SimpleNamespace

    from mimo_sft.train import launch

    boom = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    boom.__cause__ = __import__("queue").Empty()

    def body(cfg, layout):
        raise RuntimeError("reorder thread failed") from boom

    def aborted(message, code):
        raise SystemExit((message, code))

    monkeypatch.setattr(launch, "checked_config", lambda *a, **k: (None, SimpleNamespace(layout=None)))
    monkeypatch.setattr(launch, "_abort", aborted)
    with pytest.raises(SystemExit) as stop:
        launch.launch_checked([], body)
    message, code = stop.value.code
    assert code == 1 and message == ("error: [rank 0] data loader: a DataLoader worker (pid 4242) died; the run stops "
                                     "(restart it from the last checkpoint)")
    assert "Traceback" not in capsys.readouterr().err
