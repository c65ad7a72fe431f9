"""A tensor-parallel worker: one process per rank other than 0, each with its GPU, its share of the weights,
its KV cache and its CUDA graphs. It joins the group (distributed.py), then runs what rank 0 sends: every
engine step's plan, prompt scoring, and the stop.

The engine starts the workers of its own node itself (executor.py). On other nodes start one per rank:

    MASTER_ADDR=<rank 0's host> MASTER_PORT=<port> tinypaged worker --rank R [--local-rank L]

A worker whose step raises leaves the error's one line in the store and exits with status 1 (rank 0 fails the
engine, naming it); one that loses rank 0 exits with status 3; after a stop it exits with 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from tinypaged.engine.device.distributed import (
    Heartbeat,
    Membership,
    PromptLogits,
    Rendezvous,
    StepPlan,
    Stop,
    error_key,
    joined_key,
    one_line,
    rank_device,
    read_config,
)
from tinypaged.engine.device.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def run_worker(rendezvous: Rendezvous, rank: int, local_rank: int) -> int:
    """Join the group as `rank` and serve rank 0's messages until it says stop; the exit status."""
    # Ctrl-C in a terminal reaches every process of the foreground group: the engine (rank 0) decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = rendezvous.store(is_master=False)
    heartbeat = Heartbeat(rendezvous, rank)
    try:
        config = read_config(store)
        store.set(joined_key(rank), str(os.getpid()))
        device = rank_device(config, local_rank)
        group = Membership.join(
            store, rank, config.tensor_parallel_size, device, not config.disable_custom_all_reduce
        )
        runner = ModelRunner(config, group.tp, device)
        while True:
            message = group.receive()
            if isinstance(message, StepPlan):
                runner.execute(message.sched, message.prompt_logits_of, None, message.graph)
            elif isinstance(message, PromptLogits):
                runner.prompt_logits(message.prompts)
            else:
                assert isinstance(message, Stop)
                break
    except BaseException as e:  # noqa: BLE001 - whatever ends a worker, rank 0 must hear why
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            store.set(error_key(rank), one_line(e))
        finally:
            os._exit(1)  # not through the interpreter's teardown: NCCL's threads may be stuck in a collective
    heartbeat.stop()
    runner.release()
    group.leave()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tinypaged.engine.device.worker --rank R` (what `tinypaged worker` runs)."""
    ap = argparse.ArgumentParser(description="a tensor-parallel worker (MASTER_ADDR, MASTER_PORT: rank 0's)")
    ap.add_argument(
        "--rank", type=int, required=True, help="this worker's rank, 1 .. tensor_parallel_size - 1"
    )
    ap.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="its GPU on this node (default: LOCAL_RANK, else the rank)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {args.rank}: %(message)s")
    local = args.local_rank if args.local_rank is not None else int(os.environ.get("LOCAL_RANK", args.rank))
    if "MASTER_PORT" not in os.environ:
        print("error: set MASTER_ADDR and MASTER_PORT to rank 0's", file=sys.stderr)
        return 2
    return run_worker(Rendezvous.from_env(), args.rank, local)


if __name__ == "__main__":
    sys.exit(main())
