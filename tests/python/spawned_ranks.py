"""Runs a test's ranks as spawned processes, one per rank, over a file store."""

import os
import tempfile


def run_ranks(test, rank_main, world, timeout=900):
    """rank_main(rank, world, store_path, failures) in `world` spawned processes; each puts its
    traceback on `failures` if it fails. Asserts, on `test`, that none did and that every process
    exited 0 within `timeout` seconds (a process still running then is killed)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    failures = context.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    processes = [context.Process(target=rank_main, args=(r, world, store, failures))
                 for r in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=timeout)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    messages = []
    while not failures.empty():
        messages.append(failures.get())
    test.assertEqual(messages, [])
    test.assertEqual([p.exitcode for p in processes], [0] * world)
