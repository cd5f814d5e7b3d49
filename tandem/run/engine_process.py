"""The engine in a process of its own (placement "separate"): spawned, serving the HTTP API on a free port of
127.0.0.1, stopped by its parent, and gone with its parent when that one dies (its end of the pipe closes).

On CUDA the process sees only its own GPU (CUDA_VISIBLE_DEVICES), where it is cuda:0: every thread of it (the
engine's loop, the server's workers receiving weights) then works on that GPU without setting a device, and it
opens no context on the trainer's GPU. Unless it receives weights by reference (`ipc_timeout_s` given): then the
engine runs on the trainer's GPU and sees what the trainer sees, and a second pipe carries the weights
(`IpcSender` at `weights_conn`, `IpcReceiver` in the engine's process); `update_weights` has the engine receive and
load one transfer, as `/update_weights_from_distributed` does for a weight group.

The control pipe carries typed messages: the child's `Ready`/`Failed` at start-up; then the parent's `LoadWeights`
(answered by a `SyncReply` or `Failed`) and `Stop`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tandem.config import EngineConfig
from tandem.engine.client import EngineUnreachable
from tandem.run.heap import freeze_heap
from tandem.transport.sync import SyncReply, load_received
from tandem.transport.weights import TransportError


@dataclass(frozen=True)
class Ready:
    url: str


@dataclass(frozen=True)
class Failed:
    kind: str  # the exception's type name
    message: str


@dataclass(frozen=True)
class LoadWeights:
    version: int
    pause_mode: str


@dataclass(frozen=True)
class Stop:
    pass


REFUSALS = ("ValueError", "EngineError")  # the engine refused the request (HTTP's 400), the rest failed


class EngineProcess:
    """Spawns the engine and blocks until its server listens, at most `timeout_s`. Raises ValueError when the engine
    refuses its configuration, EngineUnreachable when the process dies or does not start in time. `ipc_timeout_s`:
    receive weights by reference through `weights_conn` (the engine on the trainer's device), each wait of the
    receiver bounded by it; None: the engine gets a GPU of its own and weights come over a group (HTTP)."""

    def __init__(self, model: str, config: EngineConfig, seed: int, timeout_s: float, dtype: str = "float32",
                 ipc_timeout_s: float | None = None):
        gpu = None
        self._lock = threading.Lock()  # one exchange on the control pipe at a time
        if config.device.startswith("cuda") and ipc_timeout_s is None:
            index = torch.device(config.device).index or 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible and index >= len(visible.split(",")):
                raise ValueError(f"engine.device: {config.device} is not among CUDA_VISIBLE_DEVICES={visible}")
            gpu = visible.split(",")[index] if visible else str(index)
            config = dataclasses.replace(config, device="cuda:0")
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        self._conn, child = ctx.Pipe()
        self.weights_conn, weights_child = ctx.Pipe() if ipc_timeout_s is not None else (None, None)
        self.process = ctx.Process(target=_serve, name="tandem-engine", daemon=True,
                                   args=(model, config, seed, dtype, gpu, child, weights_child, ipc_timeout_s))
        self.process.start()
        for end in (child, weights_child):  # the child's ends live on in the child only: they close when it dies
            if end is not None:
                end.close()
        self.url = ""
        try:
            ready = self._reply(timeout_s, "not serving")
            if isinstance(ready, Failed):
                message = f"{self}: the engine failed to start: {ready.kind}: {ready.message}"
                raise ValueError(message) if ready.kind == "ValueError" else RuntimeError(message)
            self.url = ready.url
        except BaseException:
            self.stop(grace_s=0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def __str__(self) -> str:
        return f"engine process pid {self.pid}" + (f" at {self.url}" if self.url else "")

    def check(self) -> None:
        """Raise EngineUnreachable if the process has exited."""
        if self.process.exitcode is not None:
            raise EngineUnreachable(f"{self}: exited with code {self.process.exitcode}")

    def update_weights(self, version: int, pause_mode: str, timeout_s: float) -> SyncReply:
        """Have the engine receive one transfer on `weights_conn` (the `IpcSender` there must send it meanwhile) and
        load it as `version`, pausing with `pause_mode` only to load. Raises ValueError when the engine refuses the
        weights (they stay as they were), TransportError when the receive failed, EngineUnreachable when the engine
        dies or does not answer within `timeout_s`."""
        with self._lock:
            reply = self._reply(timeout_s, f"did not load weights version {version}", LoadWeights(version, pause_mode))
        if isinstance(reply, SyncReply):
            return reply
        if reply.kind in REFUSALS:
            raise ValueError(f"{self}: refused weights version {version}: {reply.kind}: {reply.message}")
        raise TransportError(f"{self}: did not receive weights version {version}: {reply.message}", ranks=(1,))

    def _reply(self, timeout_s: float, what: str, command: LoadWeights | None = None) -> Ready | SyncReply | Failed:
        """Send `command`, if any; then the child's next message, waited for at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        try:
            if command is not None:
                self._conn.send(command)
            while not self._conn.poll(0.01):
                self.check()
                if time.monotonic() > deadline:
                    raise EngineUnreachable(f"{self}: {what} within {timeout_s:g} s")
            return self._conn.recv()
        except (OSError, EOFError) as e:  # its end of the pipe closed: it died
            self.process.join(1)
            self.check()
            raise EngineUnreachable(f"{self}: the pipe to it broke off: {e}") from e

    def kill(self) -> None:
        """Stop it now (it failed, or froze): no grace period."""
        self.stop(grace_s=0)

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the engine to stop (it finishes its server and its loop); kill it after `grace_s`. Idempotent.
        A weight sync still under way (its thread outlived a cancelled run) gets the grace period to finish first:
        two messages written at once would interleave on the pipe."""
        deadline = time.monotonic() + grace_s
        if self._lock.acquire(timeout=grace_s):
            try:
                with contextlib.suppress(OSError):  # already gone, or stopped before
                    self._conn.send(Stop())
            finally:
                self._lock.release()
        self.process.join(max(deadline - time.monotonic(), 0))
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
        self._conn.close()
        if self.weights_conn is not None:
            self.weights_conn.close()


def _serve(model: str, config: EngineConfig, seed: int, dtype: str, gpu: str | None, conn: Connection,
           weights_conn: Connection | None, ipc_timeout_s: float | None) -> None:
    """The engine process's main: serve until the parent says stop or goes away. `gpu`: the one GPU to see."""
    if gpu is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us in order
    from tandem.engine.engine import Engine, EngineError
    from tandem.server.http import ServerThread
    from tandem.transport.ipc import IpcReceiver
    from tandem.transport.switch import switching

    try:
        engine = Engine(model, config, dtype=dtype, seed=seed)
        server = ServerThread(engine).start()
    except Exception as e:
        conn.send(Failed(type(e).__name__, str(e)))
        return
    receiver = None if weights_conn is None else IpcReceiver(weights_conn, ipc_timeout_s, f"trainer pid {os.getppid()}")
    freeze_heap()
    conn.send(Ready(server.url))

    def load(command: LoadWeights) -> SyncReply | Failed:
        try:  # the receive on this thread, which has nothing else to do meanwhile; it wakes several times and
            # takes the GIL from the engine's thread each time (`switching`)
            # (no checksum: one engine's is compared with nothing, and it would read every weight once more)
            with switching():
                reply = loop.run_until_complete(load_received(receiver, engine, receiver.receive(), command.version,
                                                              command.pause_mode, checksum=False))
            # the previous load's gap (its start to the first step on its weights), known only once a step ran
            if (gap := engine.core.load_gap_s) is not None:
                reply = dataclasses.replace(reply, receive_phases={**reply.receive_phases, "previous_load_gap": gap})
            return reply
        except (ValueError, EngineError, TransportError) as e:
            return Failed(type(e).__name__, str(e))

    loop = asyncio.new_event_loop()  # one for every sync
    try:
        while not isinstance(command := conn.recv(), Stop):
            conn.send(load(command))
    except EOFError:  # the parent died
        pass
    finally:
        loop.close()
        if receiver is not None:
            receiver.close()
        server.stop()
        engine.shutdown()
        gc.unfreeze()  # (what `freeze_heap` kept goes before the interpreter does: no leak report at its exit)
