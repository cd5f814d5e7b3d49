"""The engine in a process of its own (placement "separate"): spawned, serving the HTTP API on a free port of
127.0.0.1, stopped by its parent, and gone with its parent when that one dies (its end of the pipe closes).

On CUDA the process sees only its own GPU (CUDA_VISIBLE_DEVICES), where it is cuda:0: every thread of it (the
engine's loop, the server's workers receiving weights) then works on that GPU without setting a device, and it
opens no context on the trainer's GPU. Unless `share_gpu`: then the engine runs on the trainer's GPU, sees what
the trainer sees, and `load_weights` hands it the trainer's tensors through the pipe between the two processes
(torch's multiprocessing pickling: a CUDA IPC handle per tensor, or shared memory on the CPU; nothing is copied
until the engine loads them). That pipe is only the parent's and the child's, never a network socket: unpickling
what arrives on it is safe, unlike over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time

import torch

from tandem.config import EngineConfig
from tandem.engine.client import EngineUnreachable


class EngineProcess:
    """Spawns the engine and blocks until its server listens, at most `timeout_s`. Raises ValueError when the engine
    refuses its configuration, EngineUnreachable when the process dies or does not start in time."""

    def __init__(self, model: str, config: EngineConfig, seed: int, timeout_s: float, dtype: str = "float32",
                 share_gpu: bool = False):
        gpu = None
        self._lock = threading.Lock()  # one exchange on the pipe at a time
        if config.device.startswith("cuda") and not share_gpu:
            index = torch.device(config.device).index or 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible and index >= len(visible.split(",")):
                raise ValueError(f"engine.device: {config.device} is not among CUDA_VISIBLE_DEVICES={visible}")
            gpu = visible.split(",")[index] if visible else str(index)
            config = dataclasses.replace(config, device="cuda:0")
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state or threads inherited
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(model, config, seed, dtype, gpu, child), name="tandem-engine",
                                   daemon=True)
        self.process.start()
        child.close()
        self.url = ""
        try:
            self.url = self._wait_ready(timeout_s)
        except BaseException:
            self.stop(grace_s=0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def __str__(self) -> str:
        return f"engine process pid {self.pid}" + (f" at {self.url}" if self.url else "")

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            self.check()
            if time.monotonic() > deadline:
                raise EngineUnreachable(f"{self}: not serving within engine_timeout_s={timeout_s:g}")
        status, kind, detail = self._conn.recv()
        if status == "ready":
            return detail
        message = f"{self}: the engine failed to start: {kind}: {detail}"
        raise ValueError(message) if kind == "ValueError" else RuntimeError(message)

    def check(self) -> None:
        """Raise EngineUnreachable if the process has exited."""
        if self.process.exitcode is not None:
            raise EngineUnreachable(f"{self}: exited with code {self.process.exitcode}")

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, pause_mode: str,
                     timeout_s: float) -> float:
        """Hand the engine `named_tensors` (shared, not copied) and have it load them as `version`; returns the
        seconds generation was excluded (pause, load, resume). The tensors must not change until this returns.
        Raises ValueError when the engine refuses them, EngineUnreachable when it dies or does not answer within
        `timeout_s`."""
        with self._lock:
            try:
                self._conn.send(("weights", named_tensors, version, pause_mode))
                deadline = time.monotonic() + timeout_s
                while not self._conn.poll(0.01):
                    self.check()
                    if time.monotonic() > deadline:
                        raise EngineUnreachable(f"{self}: did not load weights version {version} within "
                                                f"{timeout_s:g} s")
                status, kind, detail = self._conn.recv()
            except (OSError, EOFError) as e:  # its end of the pipe closed: it died
                self.process.join(1)
                self.check()
                raise EngineUnreachable(f"{self}: the weight handoff broke off: {e}") from e
        if status == "loaded":
            return detail
        raise ValueError(f"{self}: refused weights version {version}: {kind}: {detail}")

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the engine to stop (it finishes its server and its loop); kill it after `grace_s`. Idempotent.
        A weight handoff still under way (its thread outlived a cancelled run) gets the grace period to finish
        first: two messages written at once would interleave on the pipe."""
        deadline = time.monotonic() + grace_s
        if self._lock.acquire(timeout=grace_s):
            try:
                with contextlib.suppress(OSError):  # already gone, or stopped before
                    self._conn.send("stop")
            finally:
                self._lock.release()
        self.process.join(max(deadline - time.monotonic(), 0))
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
        self._conn.close()


def _serve(model: str, config: EngineConfig, seed: int, dtype: str, gpu: str | None, conn) -> None:
    """The engine process's main: serve until the parent says stop or goes away. `gpu`: the one GPU to see."""
    if gpu is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us in order
    from tandem.engine.engine import Engine, EngineError
    from tandem.server.http import ServerThread

    try:
        engine = Engine(model, config, dtype=dtype, seed=seed)
        server = ServerThread(engine).start()
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ready", "", server.url))
    try:
        while (message := conn.recv()) != "stop":
            _, named, version, pause_mode = message
            try:
                pause_s = asyncio.run(engine.load_paused(named, version, pause_mode))
                if torch.cuda.is_available():  # the copies read the trainer's tensors: done before it may change them
                    torch.cuda.synchronize()
                conn.send(("loaded", "", pause_s))
            except (ValueError, EngineError) as e:
                conn.send(("error", type(e).__name__, str(e)))
            del named, message  # the trainer's tensors: release them (their IPC handles) now
    except EOFError:  # the parent died
        pass
    finally:
        server.stop()
        engine.shutdown()

