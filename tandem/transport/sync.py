"""One weight sync as the engine reports it (`SyncReply`), and the engine's end of a sync (`receive_and_load`), the
same over every transport. Imports no torch: the HTTP client reads replies with it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.engine import Engine
    from tandem.transport.weights import TransferStats, WeightReceiver


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The engine's side of one sync: it loaded `weight_version`; `transfer_s` its receive (as its receiver timed
    it, by phase in `receive_phases`), `load_s` from the received weights to the end of the load: `pause_s`
    (generation excluded: pause, copy into the parameters, resume) and the wait for the engine's thread to take it.
    `num_bytes`, `num_buckets`, `num_tensors`: what arrived. As JSON (the reply of `/update_weights_from_distributed`,
    beside SGLang's `success` and `message`) its fields keep their names."""

    weight_version: int
    pause_s: float
    load_s: float
    transfer_s: float
    num_bytes: int
    num_buckets: int
    num_tensors: int
    receive_phases: dict[str, float] = field(default_factory=dict)
    # of the engine's weights once loaded (`tandem.transport.checksum`), where the caller asked for it: replicas compare
    weights_checksum: str = ""


    @classmethod
    def of(cls, received: TransferStats, pause_s: float, load_s: float, checksum: str = "") -> SyncReply:
        return cls(received.version, pause_s, load_s, received.seconds, received.num_bytes, received.num_buckets,
                   received.num_tensors, dict(received.phases), checksum)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SyncReply:
        """From `to_dict`'s JSON; other keys (SGLang's `success`, `message`) are ignored. Raises ValueError naming a
        missing field."""
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"sync reply: missing {', '.join(missing)} (not a tandem engine's reply?)")
        return cls(**{f.name: data[f.name] for f in fields if f.name in data})


async def receive_and_load(receiver: WeightReceiver, engine: Engine, version: int | None,
                           pause_mode: str, checksum: bool = True) -> SyncReply:
    """Receive the sender's next transfer (in a worker thread: the engine keeps generating meanwhile), refuse it unless
    it carries `version` (None: any), load it inside a pause of `pause_mode` (`Engine.load_paused`), and release it
    (also when the load failed). `checksum`: reply with the loaded weights' checksum (for replicas to compare; it
    waits for the load on the device and reads every weight once); else the reply's is "". Raises TransportError when
    the receive fails; ValueError or the engine's error when it refuses the weights, which then stay as they were."""
    return await load_received(receiver, engine, await asyncio.to_thread(receiver.receive), version, pause_mode,
                               checksum)


async def load_received(receiver: WeightReceiver, engine: Engine, received: tuple[int, Mapping], version: int | None,
                        pause_mode: str, checksum: bool = True) -> SyncReply:
    """`receive_and_load` after its receive, for a caller that ran `receiver.receive()` itself: a thread whose event
    loop serves nothing else saves the hop to a worker thread and back."""
    (sent_version, tensors), received = received, None
    t0 = time.perf_counter()
    try:
        if version is not None and version != sent_version:
            raise ValueError(f"weight_version: the request says {version}, the transfer carries {sent_version}")
        pause_s = await engine.load_paused(tensors, sent_version, pause_mode)
    finally:
        del tensors
        receiver.release()
    load_s = time.perf_counter() - t0
    if not checksum:
        return SyncReply.of(receiver.last_stats, pause_s, load_s)
    # generation goes on meanwhile (the weights stay as loaded until the next load); one on a GPU waits for its copies
    return SyncReply.of(receiver.last_stats, pause_s, load_s, await asyncio.to_thread(_checksum, engine))


def _checksum(engine: Engine) -> str:
    from tandem.transport.checksum import weights_checksum

    model = getattr(engine, "model", None)
    if model is None:  # (an engine that exposes no model, such as a test's stand-in, has no checksum)
        return ""
    parameters = list(model.named_parameters())
    if parameters and parameters[0][1].is_cuda:
        import torch

        torch.cuda.synchronize(parameters[0][1].device)
    return weights_checksum(parameters)
