"""One OpenMP team per process: keep helper threads from starting their own CPU thread teams.

torch's CPU wheels run intra-op parallelism on GNU OpenMP (libgomp). Every thread that runs a parallel torch op
gets its own team of worker threads, sized when that thread runs its first torch op (torch reads its global
thread count then, once per thread). Once a process holds more OpenMP worker threads than it has CPUs, libgomp
*throttles*: idle workers spin for ~100 iterations instead of ~300,000 before sleeping on a futex, so every
parallel region afterwards pays a sleep/wake-up round trip — for the whole process, for as long as the extra
team lives. Decoding is thousands of tiny parallel regions (few-row GEMMs, norms), so it pays heavily: on the
2-core project host a 1-row product over SmolLM2-135M's weights streamed as two transposed rows took 7-8 ms per
30 layers of 576x576 instead of 2.5-3 (one parallel GEMM per weight), and a whole decode step ~25% longer.

Two ordinary things start a second team without anyone asking:

- a **gloo collective** whose payload is above torch's grain size (32k elements): the process group's worker
  thread copies it with a parallel op. megatron-core's ``dist_checkpointing.load`` all-gathers the checkpoint's
  tensor metadata (``determine_global_metadata``), so loading any torch_dist checkpoint used to slow every
  forward after it, even at world size 1 (the gloo threads live as long as the process group);
- a **second compute thread**: the server loads a model on the main thread and decodes on its scheduler thread.

:func:`serial_helper_threads` wraps code that may run a helper thread's first torch op (collectives, checkpoint
IO): torch's thread count is 1 while it runs, so those helpers stay serial for good; :func:`in_fresh_thread`
runs one-off CPU work (loading a model to serve) on a thread that exits afterwards, taking its team with it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, TypeVar

import torch

T = TypeVar("T")

_LOCK = threading.RLock()


@contextlib.contextmanager
def serial_helper_threads() -> Iterator[None]:
    """Run the block with torch's CPU thread count at 1 (restored after), so that any other thread running its
    first torch op meanwhile (a gloo worker serving a collective, a checkpoint reader) fixes its own OpenMP team
    at one thread — no second team, no libgomp throttling (see the module docstring). The calling thread runs
    the block serially too; threads that already ran a torch op keep their size."""
    with _LOCK:
        n = torch.get_num_threads()
        if n > 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if n > 1:
                torch.set_num_threads(n)


def in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread, waited for; its value is returned and its exception re-raised
    here. The thread's OpenMP team (parallel CPU work it ran) ends with it, so the thread that later computes
    (a server's scheduler thread) holds the process's only team."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"nemo_spec-{getattr(fn, '__name__', 'work')}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
