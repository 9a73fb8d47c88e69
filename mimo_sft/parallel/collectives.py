"""The last collective each thread entered: what the hang watchdog names when ranks wait on one that never came.

Why: a hung rank's stack shows where it stopped, but the ranks that wait for it sit in a collective whose group
and peers the stack does not say. :func:`install` wraps ``torch.distributed``'s collective and point-to-point
entry points once per process (``bootstrap.start_world``, before the CPU shims bind ``all_gather`` and before
the groups exist); each call stores ``[sequence number, op, group, peer, state]`` in its thread's slot
of :data:`LAST` and calls the original. The group stays an object until someone asks (:func:`describe`, the
watchdog's thread every few seconds): its name (:func:`name_group`, given by ``parallel.groups``) and ranks are
looked up then, never on the training thread. About 0.4 microseconds per call on the CPU (docs/benchmarks.md).

What is seen: every call through the ``torch.distributed`` module attribute, and module globals that megatron or
mimo-sft bound to an original before :func:`install` ran (rebound here). Counted per call site in a 2-rank
non-colocated and a colocated run (about 25 collectives per rank per step): the distributed optimizer's
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (megatron's ``dist_reduce_scatter_func`` /
``dist_all_gather_func`` aliases), the cross-entropy's tensor-parallel ``all_reduce``, the grad-norm and optimizer
``all_reduce``s, the bridge's ``batch_isend_irecv``, ``send``, ``recv`` and ``broadcast``, and mimo-sft's own
(metrics, token counts, start-up checks); a pp 2 run adds the pipeline's ``batch_isend_irecv``. By reading megatron,
also through the attribute: ``finalize_model_grads``' reductions, the tensor-parallel mappings (``all_gather``,
``reduce_scatter``, ``all_to_all_single``), the colocated bridge's ``all_gather_into_tensor``. What is not:

* ``isend``/``irecv`` called on their own: torch's ``P2POp`` accepts only the original functions (it compares by
  identity), so they stay unwrapped; megatron calls them alone only with ``batch_p2p_comm`` off, which mimo-sft
  never sets (its pipeline batches them: ``batch_isend_irecv`` is recorded, with each op's direction and peer);
* collectives torch runs inside its own functions (the ``all_gather`` inside ``all_gather_object`` is seen as
  ``all_gather_object``), and anything bound before start-up by a library other than megatron;
* the wait: an async op (``async_op=True`` by keyword, as megatron passes it; ``batch_isend_irecv``) is recorded
  when issued (state ``issued``); its ``wait()`` is not, so a rank stuck in that wait shows the op as issued, and
  its stack shows the wait.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import weakref

#: thread id -> [seq, op, group, peer, state]; state: None while inside a synchronous call, "returned" after it,
#: "issued" for an async one
LAST: dict[int, list] = {}
#: process group -> its name in mimo-sft's layout ("language dp", "world gloo"); :func:`name_group`. Weak: a
#: destroyed group (``finetune --export-hf`` ends the training groups) is not kept alive by its name
_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ORIGINALS: dict[str, object] = {}
_SEQ = itertools.count(1)
_P2P = "batch_isend_irecv"
#: the wrapped entry points, with the parameter that names the peer (None: every rank of the group)
WRAPPED = {"all_reduce": None, "all_gather": None, "all_gather_into_tensor": None, "reduce_scatter": None,
           "reduce_scatter_tensor": None, "broadcast": "src", "reduce": "dst", "all_to_all_single": None,
           "all_to_all": None, "barrier": None, "send": "dst", "recv": "src", "all_gather_object": None,
           "broadcast_object_list": "src", "gather_object": "dst", _P2P: None}


def _recording(name: str, fn, peer_param: str | None):
    params = list(inspect.signature(fn).parameters)
    gi = params.index("group")
    pi = params.index(peer_param) if peer_param else None
    last, seq, ident = LAST, _SEQ, threading.get_ident

    if pi is None:
        def recorded(*args, **kwargs):
            slot = last[ident()] = [next(seq), name, args[gi] if len(args) > gi else kwargs.get("group"), None, None]
            out = fn(*args, **kwargs)
            slot[4] = "issued" if kwargs.get("async_op") else "returned"
            return out
    else:
        def recorded(*args, **kwargs):
            slot = last[ident()] = [next(seq), name, args[gi] if len(args) > gi else kwargs.get("group"),
                                    args[pi] if len(args) > pi else kwargs.get(peer_param), None]
            out = fn(*args, **kwargs)
            slot[4] = "issued" if kwargs.get("async_op") else "returned"
            return out

    recorded.__wrapped__ = fn
    recorded.__name__ = recorded.__qualname__ = name
    recorded.__doc__ = fn.__doc__
    return recorded


def _recording_p2p(fn):
    from torch.distributed import distributed_c10d as c10d

    last, seq, ident, isend = LAST, _SEQ, threading.get_ident, c10d.isend

    def batch_isend_irecv(p2p_op_list):
        peers = tuple(("to" if op.op is isend else "from", op.peer) for op in p2p_op_list)
        slot = last[ident()] = [next(seq), _P2P, p2p_op_list[0].group if p2p_op_list else None, peers, None]
        out = fn(p2p_op_list)
        slot[4] = "issued"
        return out

    batch_isend_irecv.__wrapped__ = fn
    batch_isend_irecv.__doc__ = fn.__doc__
    return batch_isend_irecv


def install() -> None:
    """Wrap the entry points of :data:`WRAPPED` in ``torch.distributed`` (idempotent), and rebind megatron's and
    mimo-sft's module globals that hold an original."""
    import torch.distributed as dist

    if _ORIGINALS:
        return
    for name, peer in WRAPPED.items():
        fn = getattr(dist, name)
        _ORIGINALS[name] = fn
        setattr(dist, name, _recording_p2p(fn) if name == _P2P else _recording(name, fn, peer))
    swap = {id(fn): (fn, getattr(dist, name)) for name, fn in _ORIGINALS.items()}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(("megatron.", "mimo_sft.")):
            continue
        for attr, value in list(vars(mod).items()):
            hit = swap.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])


def installed() -> bool:
    return bool(_ORIGINALS)


def name_group(group, name: str) -> None:
    """Give a process group its name for reports (``parallel.groups``: "language dp", "images tp", "world gloo");
    groups this rank is not in (None, or torch's non-member marker) are skipped. The first name given wins."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup) and group not in _NAMES:
        _NAMES[group] = name


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world)."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):  # destroyed since
        return []


def describe(slot: list | None) -> dict | None:
    """A JSON-able account of one :data:`LAST` slot: ``seq``, ``op``, ``group`` (its name, or None), ``ranks``,
    ``peers`` (``[[direction, rank], ...]``: a point-to-point op's other end, "to" or "from"), ``state`` ("in":
    inside a synchronous call, "returned", "issued": an async op, whose wait is not seen) and ``text``."""
    if slot is None:
        return None
    seq, op, group, peer, state = slot
    ranks = group_ranks(group)
    name = _NAMES.get(group) if group is not None else "world"
    if op == _P2P:
        peers = [list(p) for p in (peer or ())]
    elif peer is None:
        peers = []
    else:
        peers = [[{"src": "from", "dst": "to"}[WRAPPED[op]], int(peer)]]
    text = op
    if peers:
        text += " (" + ", ".join(f"{d} rank {r}" for d, r in peers) + ")"
    members = ",".join(map(str, ranks))
    text += f" on {name} (ranks {members})" if name else f" on a group of ranks {members}"
    return {"seq": seq, "op": op, "group": name, "ranks": ranks, "peers": peers, "state": state or "in",
            "text": text}


def last_of(thread_id: int) -> dict | None:
    """:func:`describe` of the last collective the thread ``thread_id`` entered (None: none yet)."""
    return describe(LAST.get(thread_id))
