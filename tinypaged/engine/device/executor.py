"""The executor: runs each engine step on every rank of the tensor-parallel group, and watches the ranks.

With one rank it is the ModelRunner and nothing more. With N ranks (`tensor_parallel_size`), rank 0 is this
process's ModelRunner, whose logits the sampler reads; ranks 1..N-1 are worker processes (worker.py), which this
executor starts on its node (more join from other nodes through the env:// rendezvous: distributed.py). The
scheduler and the block manager stay here: each step, rank 0 sends the step's plan (the SchedulerOutput, the
prompt logits asked for, the decode graph chosen) to every worker, then runs it itself; the forward pass's
collectives pair the ranks up on the devices.

Faults: a monitor thread watches the local workers' processes and every worker's heartbeat. A worker that
exits, or whose heartbeat stops for HEARTBEAT_TIMEOUT_S, fails the engine within seconds: the other workers are
killed, the devices' group is aborted (a collective that waits for the lost rank returns), and every later call
raises EngineDeadError naming the rank. An exception in rank 0's part of a step does the same: the ranks are out
of step after it. `shutdown()` stops every rank and frees the devices.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

from tinypaged.config import ConfigError, EngineConfig
from tinypaged.core.scheduler import SchedulerOutput
from tinypaged.engine.device.distributed import (
    HEARTBEAT_TIMEOUT_S,
    Membership,
    PromptLogits,
    Rendezvous,
    StepPlan,
    Stop,
    error_key,
    heartbeat_key,
    joined_key,
    local_world_size,
    one_line,
    publish_config,
    rank_device,
)
from tinypaged.engine.device.model_runner import ExecuteOutput, ModelRunner
from tinypaged.engine.device.staging import PendingTokens
from tinypaged.errors import EngineDeadError

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_STOP_WAIT_S = 10.0  # how long workers get to exit after a stop before they are killed


class Executor:
    """Every rank of the tensor-parallel group behind one `execute()`; `runner` is rank 0's ModelRunner."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self._group: Membership | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._listeners: list[Callable[[str], None]] = []
        self._aborted: threading.Thread | None = None  # the NCCL abort after a failure
        self._device = torch.device("cpu")
        if self.size == 1:
            self.runner = ModelRunner(config)
            self._device = self.runner.device
            return
        self._start()

    # ---- starting the group -------------------------------------------------------------------------------

    def _start(self) -> None:
        config, size = self.config, self.size
        local = local_world_size(config)
        rendezvous = Rendezvous.from_env()
        if not 1 <= local <= size:
            raise ConfigError(f"LOCAL_WORLD_SIZE {local} must be in [1, tensor_parallel_size {size}]")
        if local < size and rendezvous.port == 0:
            raise ConfigError(
                "a tensor-parallel group over several nodes needs MASTER_ADDR and MASTER_PORT set"
            )
        device = self._device = rank_device(config, 0)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ConfigError(
                f"tensor_parallel_size {size} needs {local} GPUs on this node; "
                f"{torch.cuda.device_count()} are visible"
            )
        self._store = rendezvous.store(is_master=True)
        rendezvous = Rendezvous(rendezvous.addr, self._store.port)
        publish_config(self._store, config)
        env = os.environ | {
            "MASTER_ADDR": rendezvous.addr,
            "MASTER_PORT": str(rendezvous.port),
            "LOCAL_WORLD_SIZE": str(local),
        }
        for rank in range(1, local):
            # -P: the working directory stays off sys.path (a checkout's kernels/ folder is not a module).
            cmd = [sys.executable, "-P", "-m", "tinypaged.engine.device.worker", "--rank", str(rank)]
            self._procs[rank] = subprocess.Popen(cmd, env=env | {"LOCAL_RANK": str(rank)})
        # Workers never outlive an engine that is dropped without shutdown() (they would also notice rank 0's
        # store vanish, through their heartbeat).
        self._finalizer = weakref.finalize(self, _kill, list(self._procs.values()))
        self._monitor = _Monitor(rendezvous, self._procs, size, self._fail)
        try:
            self._wait_for_workers()
            self._group = Membership.join(self._store, 0, size, device, not config.disable_custom_all_reduce)
            self.runner = ModelRunner(config, self._group.tp, device)
        except Exception as e:
            dead = self._fatal(e)
            self.shutdown()
            raise dead from e
        logger.info("tensor-parallel group of %d ranks ready (%d on this node)", size, local)

    def _wait_for_workers(self) -> None:
        """Until every worker has joined the rendezvous (a local one that dies first fails the engine)."""
        keys = [joined_key(rank) for rank in range(1, self.size)]
        t0 = last = time.monotonic()
        while not self._store.check(keys):
            self.check()
            time.sleep(_POLL_S / 2)
            if time.monotonic() - last > 30:
                last = time.monotonic()
                missing = [k.rpartition("/")[2] for k in keys if not self._store.check([k])]
                logger.warning("waiting %.0f s for tensor-parallel ranks %s", last - t0, ", ".join(missing))

    # ---- steps ----------------------------------------------------------------------------------------------

    def execute(
        self,
        sched: SchedulerOutput,
        prompt_logits_of: Collection[int] = (),
        pending: PendingTokens | None = None,
    ) -> ExecuteOutput | None:
        """The step on every rank: its plan to the workers, then rank 0's part (ModelRunner.execute)."""
        if self._group is None:
            return self.runner.execute(sched, prompt_logits_of, pending)
        self.check()
        try:
            graph = self.runner.choose_graph(sched, eager=bool(prompt_logits_of))
            self._group.send(StepPlan(sched, tuple(prompt_logits_of), graph))
            return self.runner.execute(sched, prompt_logits_of, pending, graph)
        except Exception as e:
            raise self._fatal(e) from e

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits of every position of each prompt, outside the engine's steps (ModelRunner.prompt_logits,
        on every rank)."""
        if self._group is None:
            return self.runner.prompt_logits(prompts)
        self.check()
        try:
            self._group.send(PromptLogits(prompts))
            return self.runner.prompt_logits(prompts)
        except Exception as e:
            raise self._fatal(e) from e

    @property
    def worker_pids(self) -> dict[int, int]:
        """The process id of each worker this executor started (by rank): the ones on this node."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    # ---- faults ---------------------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the group failed (None while it is sound)."""
        return self._failure

    def check(self) -> None:
        """EngineDeadError if the group has failed."""
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(why)` once when the group fails (at once if it has), from whichever thread sees it:
        a step may still be waiting on the lost rank then (a gloo collective waits for its timeout)."""
        with self._lock:
            failure = self._failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def _fail(self, message: str) -> None:
        """Fail the group (the first cause is kept): kill the workers, abort the devices' collectives."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = message
            listeners, self._listeners = self._listeners, []
        logger.error("tensor-parallel group failed: %s", message)
        _kill(list(self._procs.values()))
        if self._group is not None and self._device.type == "cuda":
            # NCCL kernels waiting for a lost rank return once the communicators are aborted. The abort gets a
            # thread of its own: it may take its time (or never end), and nothing else may wait for it.
            self._aborted = threading.Thread(
                target=self._abort_nccl, name="tinypaged-nccl-abort", daemon=True
            )
            self._aborted.start()
        for listener in listeners:
            listener(message)

    def _abort_nccl(self) -> None:
        assert self._group is not None
        t0 = time.monotonic()
        try:
            self._group.tp.group.abort()
        except Exception:  # noqa: BLE001 - best effort: the workers are gone either way
            logger.exception("aborting the NCCL communicators")
            return
        logger.warning("NCCL communicators aborted in %.1f s", time.monotonic() - t0)

    def _fatal(self, error: BaseException) -> EngineDeadError:
        """A step or start-up that raised on rank 0: the ranks are out of step. Give the monitor a moment to
        name the cause (a worker that died makes rank 0's collective fail first), else blame the error."""
        deadline = time.monotonic() + 2.0
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(_POLL_S / 4)
        self._fail(f"rank 0 failed: {one_line(error)}")
        assert self._failure is not None
        return EngineDeadError(self._failure)

    # ---- the end --------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every rank (a stop message; workers still running after _STOP_WAIT_S are killed), free rank 0's
        device memory and leave the group. Idempotent; the executor cannot run afterwards."""
        if self._closed:
            return
        self._closed = True
        if self.size > 1:
            self._stop_workers()
        if self._aborted is not None:
            self._aborted.join(_STOP_WAIT_S)
            if self._aborted.is_alive():
                # Rank 0's device may still run a collective that waits for the lost rank: any call that waits
                # for the device would hang. Its memory goes with the process.
                logger.error("NCCL's abort has not returned: rank 0's device memory is freed at exit")
                return
        if hasattr(self, "runner"):
            self.runner.release()
        if self._group is not None and (self._failure is None or self._device.type != "cuda"):
            # (After a failure on CUDA the group is not destroyed: that could wait for collectives that never end.
            # It goes with the process, which cannot form another group.)
            self._group.leave()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        if self.size > 1:
            del self._store  # rank 0's store: its listening socket closes

    def _stop_workers(self) -> None:
        self._monitor.stop()  # from now on workers exit on purpose
        if self._group is not None and self._failure is None:
            try:
                self._group.send(Stop(), wait=True)
            except Exception:  # noqa: BLE001 - the workers are killed below
                logger.exception("sending the stop to the tensor-parallel workers")
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(list(self._procs.values()))


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            logger.error("tensor-parallel worker pid %d did not exit after SIGKILL", proc.pid)


class _Monitor:
    """A thread that fails the group when a local worker's process ends or a worker's heartbeat stops."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        procs: dict[int, subprocess.Popen[bytes]],
        size: int,
        fail: Callable[[str], None],
    ) -> None:
        self._rendezvous, self._procs, self._size, self._fail = rendezvous, procs, size, fail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinypaged-tp-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before a deliberate shutdown)."""
        self._stop.set()
        self._thread.join(_STOP_WAIT_S)

    def _run(self) -> None:
        store = self._rendezvous.store(is_master=False)
        beats = dict.fromkeys(range(1, self._size), 0)
        seen = dict.fromkeys(range(1, self._size), time.monotonic())
        while not self._stop.wait(_POLL_S):
            if any(proc.poll() is not None for proc in self._procs.values()):
                # One death takes the others' collectives down with it: look again a moment later and blame
                # the first cause (killed by a signal, or gone without an error of its own) over its echoes.
                time.sleep(_POLL_S)
                exits = [
                    (rank, proc, self._exit_reason(store, rank, proc)) for rank, proc in self._procs.items()
                ]
                exits = [(rank, proc, why) for rank, proc, why in exits if why is not None]
                rank, proc, (_, why) = min(exits, key=lambda e: e[2][0])
                return self._fail(f"tensor-parallel worker {rank} (pid {proc.pid}) {why}")
            now = time.monotonic()
            for rank in beats:
                n = store.add(heartbeat_key(rank), 0)
                if n != beats[rank]:
                    beats[rank], seen[rank] = n, now
                elif n and now - seen[rank] > HEARTBEAT_TIMEOUT_S:
                    return self._fail(
                        f"tensor-parallel worker {rank} sent no heartbeat for {now - seen[rank]:.0f} s (hung or gone)"
                    )

    @staticmethod
    def _exit_reason(store: dist.Store, rank: int, proc: subprocess.Popen[bytes]) -> tuple[int, str] | None:
        """(precedence, text) of a worker's exit, or None while it runs: a signal first, then an exit with no
        error of its own, then one whose error it reported (often a collective that lost a peer)."""
        code = proc.poll()
        if code is None:
            return None
        if code < 0:
            return 0, f"was killed by signal {-code}"
        error = store.get(error_key(rank)).decode() if store.check([error_key(rank)]) else None
        return (2, f"exited with status {code}: {error}") if error else (1, f"exited with status {code}")
