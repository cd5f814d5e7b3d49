"""Weight transport over torch.distributed: `DistSender`/`DistReceiver`, a dedicated group in which rank 0 is the
trainer and ranks 1..N are engines (or the tensor-parallel ranks of engines: every receiver gets every full tensor).

One transfer over the group, every step bounded by `timeout_s`:
1. hello: each engine sends HELLO to rank 0, which waits for all of them and names those that did not come.
   Without it a missing engine goes unnoticed: a gloo broadcast returns on the root once its bytes are buffered.
   A gloo send completes only once the peer has posted its receive, so an engine fails here too, naming rank 0,
   when the trainer does not start the transfer. The sender gathers and flattens its first bucket before it waits
   for the hellos: that work overlaps the engines' start (an HTTP call away).
2. buckets: tensors grouped by dtype into flat buckets of about `bucket_bytes`. Per bucket, its metadata as JSON is
   broadcast on the control group in one fixed-size frame (a second broadcast only for what does not fit; always gloo,
   so it also works beside NCCL), then its flat tensor in ONE broadcast on the data group (the chosen backend).
   Never a collective per tensor: that is the classic slow weight sync.
   Pipelined: the sender starts a bucket's data broadcast without waiting for it, gathers and flattens the next
   bucket while it travels (on CUDA the broadcast runs on NCCL's stream, the flattening copies on the current one),
   sends that bucket's metadata and starts its broadcast behind the first, and only then waits for the first. The
   receiver starts each bucket's receive as soon as its metadata arrives and waits for them all at the end. So the
   link always has the next bucket queued: no host round trip between two buckets' data. At most two flat
   buckets exist on the sender at once.
3. done: each engine sends DONE to rank 0, so `send` returns only once every engine holds every tensor.
4. commit (only when `send` is given one): the sender runs its `commit` (replicas: pause every engine), then
   broadcasts go (or, if `commit` failed, withdraw) on the control group; the receivers return the transfer only on
   go. So several engines can be made to load together: none loads before every one holds the whole transfer.

Bad input found by the sender mid-transfer is broadcast as an `error` bucket, so the engines raise at once instead of
timing out, and the group stays usable. After a `TransportError` (a timeout, a dead peer) it is not: gloo closes the
connection on a timeout, so close the transport and build a new one.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.transport.buckets import BucketMeta, back_to_back, buckets, flatten, mark_last, torch_dtype
from tandem.transport.switch import switching
from tandem.transport.weights import (
    FlatTensors,
    NamedTensors,
    TransferStats,
    TransportError,
    WeightReceiver,
    WeightSender,
    aborted,
    check_timeout,
)

HELLO, DONE = 1, 2  # point-to-point tags on the control group
POLL_S = 5e-5  # how often a wait for a bucket's data checks whether it has landed
META_BYTES = 64 << 10  # a bucket's metadata frame: its length and up to this much JSON (~700 tensors) in one broadcast
MAX_META_BYTES = 1 << 30  # a longer metadata length is a corrupt frame


class _Laps:
    """Where one end's transfer time went: `lap(phase)` adds the time since the previous lap (or the start) to
    `phase`; `phases` in the order given, `seconds` from the start to the last lap (their sum, however long the
    thread waits for the GIL before it reads it)."""

    def __init__(self, *phases: str):
        self.phases = dict.fromkeys(phases, 0.0)
        self.start = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    @property
    def seconds(self) -> float:
        return self.last - self.start


# ---- torch.distributed -----------------------------------------------------------------------------------------


def rendezvous(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store for a group (a weight group, the trainer's ranks): listening from here on, on a port the
    system chose (`.port`), so no other process can take the port between its choice and the other ranks' joining
    (tcp://host:port). A weight group's rank 0 passes it to `DistSender` as its `init_method`."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=check_timeout(timeout_s)), wait_for_workers=False)


class _DistEnd:
    """What both ends share: the rendezvous, the two groups, the rank labels, and waits that fail loudly.
    The groups are standalone (not `init_process_group`), so they live beside any default group of the process."""

    def __init__(self, init_method: str | dist.TCPStore, world_size: int, rank: int, backend: str,
                 timeout_s: float, label: str | None, device: str | torch.device | None):
        store = init_method if isinstance(init_method, dist.TCPStore) else None
        if store is not None:
            if rank != 0:
                raise ValueError(f"init_method: a store is rank 0's (`rendezvous`), got one for rank {rank}")
            init_method = f"tcp://{store.host}:{store.port}"
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method: expected tcp://host:port, got {init_method!r}")
        if world_size < 2:
            raise ValueError(f"world_size: the trainer and at least one engine make 2 or more, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")
        self.init_method, self.world_size, self.rank, self.backend = init_method, world_size, rank, backend
        self.timeout_s = check_timeout(timeout_s)
        self.timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            if self.device.type != "cuda":
                raise ValueError(f"device: nccl needs a CUDA device, got {self.device}")
        self.labels: dict[int, str] = {}
        self.broken: str | None = None
        self._failed_works: list = []  # kept alive until close: gloo may still touch their buffers

        try:
            self.store = store if store is not None else dist.TCPStore(url.hostname, url.port, None, rank == 0,
                                                                       self.timeout, wait_for_workers=False)
        except RuntimeError as e:
            where = "host" if rank == 0 else "reach rank 0's"
            raise TransportError(f"weights (rank {rank}): could not {where} rendezvous store at {url.netloc} "
                                 f"within timeout_s={self.timeout_s:g}: {e}", ranks=(0,)) from e
        self.labels = self._join(label or "")
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("weights/control", self.store), rank, world_size,
                                             self.timeout)
        self.data = self.control if backend == "gloo" else self._nccl_group()

    def _join(self, label: str) -> dict[int, str]:
        """Publish this rank's label, wait for every rank's; names the ranks that never joined."""
        keys = [f"weights/join/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], label)
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as e:
            try:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            except RuntimeError:
                raise TransportError(f"weights (rank {self.rank}): rank 0's rendezvous store closed before every "
                                     f"rank joined {self.init_method}", ranks=[0]) from e
            raise TransportError(f"weights (rank {self.rank}): {self._who(missing)} did not join {self.init_method} "
                                 f"within timeout_s={self.timeout_s:g}", ranks=missing) from e
        return {r: self.store.get(key).decode() for r, key in enumerate(keys)}

    def _nccl_group(self):
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True  # the transfer runs while the engine's steps fill the GPU
        options._timeout = self.timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("weights/data", self.store), self.rank, self.world_size,
                                     options)

    def _who(self, ranks: Iterable[int]) -> str:
        return ", ".join(f"rank {r}" + (f" ({self.labels[r]})" if self.labels.get(r) else "") for r in ranks)

    def _peers(self) -> list[int]:
        return list(range(1, self.world_size)) if self.rank == 0 else [0]

    def _fail(self, message: str, peers: Iterable[int], bucket: int | None = None) -> TransportError:
        self.broken = message
        return TransportError(f"weights (rank {self.rank}): {message}", ranks=peers, bucket=bucket)

    def _begin(self) -> None:
        """Refuse a broken or closed transport; bind the calling thread to the transport's CUDA device (NCCL and the
        allocations use the current one)."""
        if self.broken:
            raise TransportError(f"weights (rank {self.rank}): this transport failed earlier ({self.broken}); "
                                 "close it and build a new one")
        if self.control is None:
            raise TransportError(f"weights (rank {self.rank}): this transport is closed")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _wait(self, start: Callable[[], dist.Work], what: str, bucket: int | None = None) -> None:
        """Start one operation with every peer and wait for it at most the timeout."""
        try:
            work = start()
        except RuntimeError as e:
            raise self._timed_out(what, bucket, e) from e
        self._complete(work, what, bucket)

    def _complete(self, work: dist.Work, what: str, bucket: int | None = None,
                  timeout: timedelta | None = None) -> None:
        """Wait for a started operation at most the timeout."""
        try:
            work.wait(timeout or self.timeout)
        except RuntimeError as e:
            raise self._timed_out(what, bucket, e) from e

    def _timed_out(self, what: str, bucket: int | None, e: Exception) -> TransportError:
        where = "" if bucket is None else f" of bucket {bucket}"
        return self._fail(f"{what}{where} with {self._who(self._peers())} failed or timed out "
                          f"(timeout_s={self.timeout_s:g}): {e}", self._peers(), bucket)

    def _start_broadcast(self, tensor_N: Tensor, group, what: str, bucket: int) -> dist.Work:
        """Start broadcasting `tensor_N` from rank 0 on `group`; returns the operation, not yet waited for."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            return group.broadcast([tensor_N], options)
        except RuntimeError as e:
            raise self._timed_out(what, bucket, e) from e

    def _broadcast(self, tensor_N: Tensor, group, what: str, bucket: int) -> None:
        self._complete(self._start_broadcast(tensor_N, group, what, bucket), what, bucket)

    def _land(self, in_flight: list, keep: int = 0) -> None:
        """Wait for the oldest data broadcasts in `in_flight` ((work, ..., bucket index) each, oldest first) until
        only the newest `keep` remain. Polls each one's completion: NCCL's own wait with a timeout sleeps in steps
        of a millisecond or more, which cost every bucket that much on each end."""
        while len(in_flight) > keep:
            work, *_, index = in_flight.pop(0)
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            # at once when it completed; otherwise a last short wait that fails with the backend's own error
            self._complete(work, "data", index, timedelta(seconds=max(deadline - time.monotonic(), 2e-3)))

    def _meta(self, meta: BucketMeta | None, index: int) -> BucketMeta:
        """Broadcast one bucket's metadata from rank 0 (`meta` is None on receivers): a frame of `META_BYTES`, its
        length and as much of it as fits, then the rest only if it did not fit. One gloo operation per bucket, not
        two: each is a round trip between the two ends' Python threads."""
        frame, fits = torch.empty(META_BYTES, dtype=torch.uint8), META_BYTES - 8
        if meta is not None:
            payload = meta.to_bytes()
            frame[:8] = torch.tensor([len(payload)]).view(torch.uint8)
            frame[8:8 + min(len(payload), fits)] = torch.frombuffer(bytearray(payload[:fits]), dtype=torch.uint8)
        self._broadcast(frame, self.control, "metadata", index)
        length = int(frame[:8].view(torch.int64))
        if not 0 < length <= MAX_META_BYTES:
            raise self._fail(f"unreadable metadata of bucket {index}: length {length}", [0], index)
        rest = torch.empty(0, dtype=torch.uint8)
        if length > fits:
            rest = (torch.frombuffer(bytearray(payload[fits:]), dtype=torch.uint8) if meta is not None
                    else torch.empty(length - fits, dtype=torch.uint8))
            self._broadcast(rest, self.control, "metadata", index)
        if meta is not None:
            return meta
        try:
            return BucketMeta.from_bytes(frame[8:8 + min(length, fits)].numpy().tobytes() + rest.numpy().tobytes())
        except (ValueError, TypeError) as e:
            raise self._fail(f"unreadable metadata of bucket {index}: {e}", [0], index) from e

    def close(self) -> None:
        if self.backend == "nccl" and getattr(self, "data", None) is not None:
            # abort, not shutdown: a clean shutdown can block until the peer tears its end down, on its own
            # schedule; nothing is in flight here any more
            self.data.abort()
        self.control = self.data = self.store = None
        self._failed_works = []


class DistSender(_DistEnd, WeightSender):
    """Rank 0 of the weight group: the trainer. `bucket_bytes` bounds one bucket (slime uses 512 MiB, AReaL 1 GiB);
    a bigger tensor travels alone. `init_method`: tcp://host:port, or (better) the store `rendezvous` made, whose
    port the receivers join. The constructor blocks until every rank has joined (at most `timeout_s`). `label`
    names this rank in the peers' error messages, e.g. "trainer at 10.0.0.1". `device` (nccl only): the CUDA
    device buckets are flattened on (default: the current one). `pipeline`: overlap gathering and flattening the
    next bucket with the broadcast of this one (see the module docstring); False waits for every broadcast before
    touching the next bucket (the reference the pipelined path is tested against)."""

    def __init__(self, init_method: str | dist.TCPStore, world_size: int, rank: int = 0, backend: str = "gloo",
                 timeout_s: float = 60.0, bucket_bytes: int = 512 << 20, label: str | None = None,
                 device: str | torch.device | None = None, pipeline: bool = True):
        if rank != 0:
            raise ValueError(f"rank: the sender is rank 0, got {rank}")
        if not bucket_bytes > 0:
            raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes!r}")
        self.bucket_bytes, self.pipeline = bucket_bytes, pipeline
        super().__init__(init_method, world_size, rank, backend, timeout_s, label, device)

    def send(self, named_tensors: NamedTensors, version: int,
             commit: Callable[[], None] | None = None) -> TransferStats:
        """`commit`: called (in this thread) once every receiver holds the transfer and before any returns it;
        an exception from it withdraws the transfer (every receiver raises) and is raised here."""
        self._begin()
        with switching():
            return self._send(named_tensors, version, commit)

    def _send(self, named_tensors: NamedTensors, version: int, commit: Callable[[], None] | None) -> TransferStats:
        # the hello, gathering and flattening buckets, their metadata, starting their data, waiting for the data of
        # the one before last (its memory is reused), the last ones' data, the confirmation, the commit
        laps = _Laps("hello", "flatten", "metadata", "post", "reuse", "land", "done")  # (and "commit", if any)
        greeted = False  # the first bucket is gathered and flattened while the engines' hellos arrive
        num_buckets = num_tensors = num_bytes = 0
        in_flight: list[tuple[dist.Work, Tensor, int]] = []  # (operation, flat_N kept alive, bucket index), two at most
        try:
            # taking the next bucket from the generator gathers its tensors, then `flatten` copies them: both
            # overlap the broadcast in flight
            for bucket, is_last in mark_last(buckets(named_tensors, self.bucket_bytes)):
                laps.lap("flatten")
                self._land(in_flight, keep=1)  # the one before the last: its memory goes to the next flat bucket
                laps.lap("reuse")
                meta = BucketMeta(num_buckets, version, is_last=is_last, hold=commit is not None)
                flat_N = flatten(bucket, meta, self.device)
                laps.lap("flatten")
                if not greeted:
                    self._gather(HELLO, "start receiving")
                    greeted = True
                    laps.lap("hello")
                self._meta(meta, num_buckets)
                laps.lap("metadata")
                if meta.numel:
                    in_flight.append((self._start_broadcast(flat_N, self.data, "data", num_buckets), flat_N,
                                      num_buckets))
                    if not self.pipeline:
                        self._land(in_flight)
                num_buckets, num_tensors = num_buckets + 1, num_tensors + len(bucket)
                num_bytes += flat_N.numel() * flat_N.element_size()
                laps.lap("post")
            self._land(in_flight)
            laps.lap("land")
        except TransportError:
            raise
        except Exception as e:
            # bad input: tell the engines now rather than let them time out; the group stays in step
            if not greeted:
                self._gather(HELLO, "start receiving")
            self._land(in_flight)
            self._meta(BucketMeta(num_buckets, version, is_last=True, error=f"{type(e).__name__}: {e}"), num_buckets)
            raise
        self._gather(DONE, "confirm the transfer")
        laps.lap("done")
        if commit is not None:
            go = torch.ones(1, dtype=torch.int64)
            try:
                commit()
            except BaseException:
                go.zero_()
                raise
            finally:
                self._broadcast(go, self.control, "commit", num_buckets)
            laps.lap("commit")
        return TransferStats(version, num_bytes, num_buckets, num_tensors, laps.seconds, laps.phases["hello"],
                             laps.phases)

    def _gather(self, tag: int, what: str) -> None:
        """One message from every receiver, all within one timeout; names every rank that did not send."""
        try:
            works = {r: self.control.recv([torch.zeros(1, dtype=torch.int64)], r, tag) for r in self._peers()}
        except RuntimeError as e:  # a connection already closed: its peer died
            raise self._fail(f"cannot wait for {self._who(self._peers())} to {what}: {e}", self._peers()) from e
        deadline = time.monotonic() + self.timeout_s
        missing = []
        for r, work in works.items():
            try:  # at least 2 ms: a zero timedelta would mean "wait forever"
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 2e-3)))
            except RuntimeError:
                missing.append(r)
        if missing:
            self._failed_works += works.values()
            raise self._fail(f"{self._who(missing)} did not {what} within timeout_s={self.timeout_s:g}", missing)


class DistReceiver(_DistEnd, WeightReceiver):
    """Ranks 1..N of the weight group: an engine, or one tensor-parallel rank of one. Received tensors live on the
    CPU (gloo) or on `device` (nccl; default: the current CUDA device), complete when `receive` returns (it
    synchronizes its own stream, not the device's others), so another thread may load them (`load_weights` keeps
    their memory from reuse until its copies have run). `last_stats` describes the last completed `receive`. The
    constructor blocks until every rank has joined (at most `timeout_s`). `label` names this rank in the trainer's
    error messages, e.g. "engine-0 at 127.0.0.1:30001"."""

    def __init__(self, init_method: str, world_size: int, rank: int, backend: str = "gloo",
                 timeout_s: float = 60.0, label: str | None = None, device: str | torch.device | None = None):
        if rank == 0:
            raise ValueError("rank: rank 0 is the sender; receivers are ranks 1..world_size-1")
        super().__init__(init_method, world_size, rank, backend, timeout_s, label, device)
        self.last_stats: TransferStats | None = None
        # the receive's own stream: NCCL's stream waits for the issuing stream before each bucket, and on the
        # engine's stream that meant waiting for every step queued there (a whole graph replay at a time)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def receive(self) -> tuple[int, FlatTensors]:
        self._begin()
        with switching(), torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return self._receive()

    def _receive(self) -> tuple[int, FlatTensors]:
        laps = _Laps("hello", "metadata", "post", "land", "ack")  # (and "commit", if any)
        self._wait(lambda: self.control.send([torch.tensor([self.rank])], 0, HELLO), "handshake")
        laps.lap("hello")
        num_bytes = num_tensors = 0
        receiving: list[tuple[dist.Work, int]] = []  # started, not yet waited for (the sender has them queued)
        posted: list[tuple[BucketMeta, Tensor]] = []
        for index in itertools.count():
            meta = self._meta(None, index)
            laps.lap("metadata")
            if meta.error is not None:
                self._land(receiving)  # what was sent before the error: the group stays in step
                message = aborted(self._who([0]), meta.weight_version, meta.error)
                raise TransportError(f"weights (rank {self.rank}): {message} (at bucket {index})", [0], index)
            if meta.index != index:
                raise self._fail(f"expected bucket {index}, got bucket {meta.index}", [0], index)
            if not back_to_back(meta):
                raise self._fail(f"bucket {index}: its tensors' offsets and shapes do not fill its {meta.numel} "
                                 "elements back to back", [0], index)
            dtype = torch_dtype(meta.dtypes[0]) if meta.dtypes else torch.uint8
            flat_N = torch.empty(meta.numel, dtype=dtype, device=self.device)
            if meta.numel:
                receiving.append((self._start_broadcast(flat_N, self.data, "data", index), index))
            posted.append((meta.names, meta.shapes, flat_N))
            num_bytes, num_tensors = num_bytes + flat_N.numel() * flat_N.element_size(), num_tensors + len(meta.names)
            laps.lap("post")  # allocating, starting
            if meta.is_last:
                break
        self._land(receiving)
        if self.stream is not None:
            self.stream.synchronize()
        laps.lap("land")
        self._wait(lambda: self.control.send([torch.tensor([self.rank])], 0, DONE), "final acknowledgement")
        laps.lap("ack")
        if meta.hold:
            go = torch.zeros(1, dtype=torch.int64)
            self._broadcast(go, self.control, "commit", index + 1)
            if not go.item():
                raise TransportError(f"weights (rank {self.rank}): {self._who([0])} withdrew weights version "
                                     f"{meta.weight_version} after sending them", [0])
            laps.lap("commit")
        self.last_stats = TransferStats(meta.weight_version, num_bytes, index + 1, num_tensors, laps.seconds,
                                        phases=laps.phases)
        return meta.weight_version, FlatTensors(posted)
