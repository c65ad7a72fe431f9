"""Joining a tensor-parallel group, for rank 0 (the driver) and the workers alike: torch.distributed's env://
rendezvous, the two process groups, the heartbeats, and the messages rank 0 sends every rank.

The rendezvous is env://'s: a TCPStore that rank 0 hosts on MASTER_ADDR:MASTER_PORT (127.0.0.1 and a free port
when they are not set), which every worker reaches. Through it rank 0 publishes the engine's configuration (as
JSON: a worker needs only the address and its rank), the workers announce themselves, report a fatal error
(its one-line text) and beat a heartbeat counter. Then two process groups: the devices' (NCCL on CUDA, gloo on
the CPU: the model's collectives) and a gloo group on the host for the messages (each step's plan), which may
wait for the next step as long as the engine stays idle.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import ScheduledSeq, SchedulerOutput
from tinypaged.engine.device.model_runner import GraphChoice, resolve_device
from tinypaged.model.parallel import SymmMemAllReduce, TPGroup

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# A rank whose heartbeat stops for this long is hung (SIGSTOP, a frozen host): the engine fails.
HEARTBEAT_TIMEOUT_S = 10.0
# The longest a collective of the devices' group waits for a peer. A peer that dies or stops beating fails the
# engine sooner (local workers are killed, NCCL's collectives aborted), but a gloo collective waiting on a hung
# worker of another node returns only after this.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
_IDLE_TIMEOUT = timedelta(days=365)  # the message group waits for the next step however long the engine idles

_CONFIG = "tinypaged/config"


def heartbeat_key(rank: int) -> str:
    """The store counter a rank's heartbeat increments."""
    return f"tinypaged/heartbeat/{rank}"


def joined_key(rank: int) -> str:
    """The store key a rank sets once it has read the configuration."""
    return f"tinypaged/joined/{rank}"


def error_key(rank: int) -> str:
    """The store key where a rank leaves the one-line text of the error that ended it."""
    return f"tinypaged/error/{rank}"


# ---- messages from rank 0 -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """One engine step as every rank runs it: the scheduler's output, the sequences whose prompt logits are
    asked for, and the CUDA graph to replay, as rank 0 chose it."""

    sched: SchedulerOutput
    prompt_logits_of: tuple[int, ...]
    graph: GraphChoice

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Plain tuples and msgspec Structs, several times faster both ways than the frozen dataclasses field by
        # field, on the host's path of every step (the workers need neither the preempted nor the ignored
        # requests).
        s = self.sched
        seqs = s.scheduled
        moves = (s.blocks_to_swap_out, s.blocks_to_swap_in, s.blocks_to_copy, s.num_batched_tokens)
        return _step_plan, (seqs, moves, self.prompt_logits_of, tuple(self.graph))


def _step_plan(
    seqs: tuple[ScheduledSeq, ...],
    moves: tuple[Any, ...],
    prompt_logits_of: tuple[int, ...],
    graph: tuple[int, int],
) -> StepPlan:
    out, swap_in, copy, tokens = moves
    sched = SchedulerOutput(seqs, out, swap_in, copy, (), (), tokens)
    return StepPlan(sched, prompt_logits_of, GraphChoice(*graph))


@dataclass(frozen=True)
class PromptLogits:
    """Score these prompts outside the engine's steps (`ModelRunner.prompt_logits`)."""

    prompts: list[list[int]]


@dataclass(frozen=True)
class Stop:
    """Leave the group and exit."""


Message = StepPlan | PromptLogits | Stop


# ---- the rendezvous -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    """Where the group meets: env://'s MASTER_ADDR and MASTER_PORT."""

    addr: str
    port: int

    @classmethod
    def from_env(cls) -> Rendezvous:
        """MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default 0: any free port, chosen by rank 0)."""
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))

    def store(self, is_master: bool, timeout: timedelta = timedelta(seconds=60)) -> dist.TCPStore:
        """A client of the group's store (rank 0: its host, listening on `port`)."""
        return dist.TCPStore(
            self.addr, self.port, is_master=is_master, wait_for_workers=False, timeout=timeout
        )


def publish_config(store: dist.Store, config: EngineConfig) -> None:
    """Rank 0: put the engine's arguments where the workers read them."""
    args = {f.name: getattr(config, f.name) for f in EngineConfig.engine_args()}
    store.set(_CONFIG, json.dumps(args, default=str))


def read_config(store: dist.Store) -> EngineConfig:
    """A worker: the engine's configuration as rank 0 published it (checked again here)."""
    args = json.loads(store.get(_CONFIG))
    model = args.pop("model")
    return EngineConfig.from_kwargs(Path(model) if model is not None else None, **args)


def local_world_size(config: EngineConfig) -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE (torchrun's name) when the group spans nodes, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", config.tensor_parallel_size))


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of the rank with this index on its node, made current: cuda:local_rank on a GPU machine.
    On the CPU the node's ranks share its cores: each rank's torch uses its share of them."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size(config)))
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@dataclass
class Membership:
    """This process's place in the group: its TPGroup (the devices' collectives) and the message group."""

    tp: TPGroup
    messages: dist.ProcessGroup
    # Rank 0: the last message's buffers and broadcasts, kept until they complete (see send).
    _sent: tuple[Any, ...] = field(default=(), repr=False)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        custom_all_reduce: bool = True,
    ) -> Membership:
        """Form the process groups (every rank calls this, in the same order); `custom_all_reduce`: small
        all-reduces through symmetric memory where the ranks are one node's GPUs."""
        if device.type == "cuda":
            # Faults are handled by the engine (executor.py), which aborts the group itself: NCCL's watchdog
            # must not tear the process down meanwhile.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore("tinypaged/pg", store),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        messages = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        group = dist.group.WORLD
        # Symmetric memory needs every rank on this node's GPUs (its peers' buffers mapped over NVLink).
        one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size
        fast = None
        if custom_all_reduce and device.type == "cuda" and one_node:
            fast = SymmMemAllReduce.create(group, device)
        return cls(TPGroup(rank, world_size, group, fast), messages)

    def send(self, message: Message, wait: bool = False) -> None:
        """Rank 0: the message to every other rank, as its length and then its pickle. The broadcasts run on
        gloo's threads: rank 0 goes on with its own part of the step meanwhile, and the message's buffers are
        kept until the next send (or `wait`) finds them done; a failed broadcast raises there."""
        self.flush()
        payload = torch.frombuffer(
            bytearray(pickle.dumps(message, pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [dist.broadcast(t, src=0, group=self.messages, async_op=True) for t in (size, payload)]
        self._sent = (size, payload, works)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Rank 0: wait until the last message has gone out."""
        if self._sent:
            works = self._sent[2]
            self._sent = ()
            for work in works:
                work.wait()

    def receive(self) -> Message:
        """A worker: the next message from rank 0 (waits as long as it takes)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.messages)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.messages)
        message: Message = pickle.loads(memoryview(payload.numpy()))
        return message

    def leave(self) -> None:
        """Destroy the process groups (frees NCCL's buffers)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def one_line(e: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Heartbeat:
    """A worker's heartbeat: a thread that increments the rank's counter in the store every
    HEARTBEAT_INTERVAL_S, and ends the process when the store (hosted by rank 0) is gone: a worker never
    outlives its engine."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self._rendezvous, self._rank = rendezvous, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tinypaged-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = self._rendezvous.store(is_master=False, timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S))
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                store.add(heartbeat_key(self._rank), 1)
        except Exception as e:  # noqa: BLE001 - any failure to reach rank 0 means the engine is gone
            if not self._stop.is_set():
                logger.error("tensor-parallel rank %d lost rank 0 (%s); exiting", self._rank, one_line(e))
                os._exit(3)

    def stop(self) -> None:
        """Stop beating (before a clean exit)."""
        self._stop.set()
