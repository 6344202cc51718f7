"""Run a function in N local gloo processes, as torchrun would, but bounded and reported.

For tests and benchmarks on one machine. `run_distributed(fn, world_size, *args)` starts `world_size` processes, each joining one gloo
process group through a FileStore in a fresh temporary directory (never a TCP port, so tests
running at the same time cannot collide), calls `fn(rank, world_size, *args)` and returns the
list of per-rank return values. If a rank raises, the others are given a short grace period
and then killed, and the caller gets one error naming the rank and its traceback; if the whole
group exceeds `timeout` seconds it is killed and reported. No test can hang.

`fn` must be a module-level function (it is pickled by reference into the children).
Processes come from a forkserver that has imported torch once: starting a group then costs
well under a second instead of one torch import per rank (~20 s for 8 ranks on 2 busy cores).
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


class DistributedRunError(RuntimeError):
    """A spawned rank failed or the group timed out; the message carries the rank's traceback."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_dir: str,
    pg_timeout: float,
    results: Any,
    args: tuple,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated collective names
    import logging

    # full_tensor() of strided expert shards warns that it needs two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_dir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        # plain pickle bytes: torch's queue would share tensors through this process's
        # memory, which is gone once it exits
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # report everything, including KeyboardInterrupt from a kill
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    grace: float = 10.0,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results.

    Raises DistributedRunError when any rank raises (after killing the rest at most `grace`
    seconds later) or when the group runs longer than `timeout` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cadenza-dist-") as store_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store_dir, pg_timeout, results, args),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        try:
            while len(outputs) + len(errors) < world_size:
                now = time.monotonic()
                if now > deadline:
                    break
                if first_error_at is not None and now > first_error_at + grace:
                    break
                try:
                    rank, status, payload = results.get(timeout=0.2)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs and r not in errors
                    ]
                    for r in dead:
                        errors[r] = f"process exited with code {procs[r].exitcode} without a result"
                        first_error_at = first_error_at or time.monotonic()
                    continue
                if status == "ok":
                    outputs[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                    first_error_at = first_error_at or time.monotonic()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    if errors:
        first = next(iter(errors))  # the first to report is the cause; the rest follow from it
        others = sorted(set(errors) - {first})
        raise DistributedRunError(
            f"rank {first} of {world_size} failed"
            + (f" (ranks {others} failed too)" if others else "")
            + f":\n{errors[first]}"
        )
    if len(outputs) < world_size:
        missing = sorted(set(range(world_size)) - set(outputs))
        raise DistributedRunError(
            f"ranks {missing} of {world_size} gave no result within {timeout:.0f} s; killed them"
        )
    return [outputs[r] for r in range(world_size)]
