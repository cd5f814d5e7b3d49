"""Where the engine's device work runs, as data, and the ordering properties checked over it. Torch-free.

A placement lists the device work of one engine iteration (`Work`), in the order the host issues it, with the
stream each runs on and the cross-stream ordering edges (`after`). The engine's GPU paths take their streams and
edges from it (`tandem.engine.streams.StreamRuntime`), so the description cannot drift from the code: entering a
work the placement does not name is an error, and a CPU test traces what the code issues against it.

`check` unrolls a sequence of iterations on `tp` ranks into a happens-before graph and checks, exhaustively over
the schedules the graph allows:
  - no hang: the graph is acyclic once each collective is one node that every rank must reach;
  - `sync_behind_collective`: no host sync before an iteration's launch (its scheduling and preparation) newly
    waits for a collective of an earlier iteration (a bounded stall there becomes a cluster-wide hang: the hazard
    of sgl-project#622/#649); one an earlier host sync of the rank already waited for is known complete;
  - `race`: any two accesses to one buffer, one a write, are ordered in issue order. This covers the buffers a
    graph replay reads (written before the replay, not rewritten until it retired) and every host-tier and
    transfer copy (it follows the compute that produced its source; compute that reads its result waits for it).
See docs/streams.md for the placement in words and why each edge exists.

Edges. Work on one stream runs in issue order. `after` names a work (the latest instance issued before this one,
as the runtime waits for the event recorded last; `name@-1`: the latest of an earlier iteration; a lagging work's,
which waits on an event it holds: the instance of its own iteration) or a stream (everything issued on it so far:
`wait_stream`). A `sync` blocks the host: it completes after what it waits for (its `after`, and on a device stream
everything issued there before it). What the host does (syncs, host work) precedes everything it issues later.
Buffers named `x@-1` are the previous iteration's `x`; `fresh` buffers are allocated anew each iteration (so `x` in
two iterations are two buffers), the others are one buffer reused by every iteration. `held` buffers: the elements
a work touches stay referenced until it is reaped, so no later-issued work writes them (the host tier's rule 3);
later writers of those buffers need no edge. `unread` buffers: the elements a work writes are read by no
later-issued work until it is reaped (the host tier's rule 4: a load takes a page whose backup is in flight from
the backup's staging); later readers of those buffers need no edge.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Literal

DEVICE_STREAMS = ("compute", "prep", "tier", "backup", "transport", "collective")
STREAMS = ("host", *DEVICE_STREAMS)
Kind = Literal["copy", "kernel", "replay", "collective", "wait", "sync"]


@dataclass(frozen=True)
class Work:
    name: str
    stream: str
    kind: Kind
    phase: Literal["schedule", "prepare", "forward", "finish", "weights"] = "forward"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    # holds collectives: "tp" of the engine's tensor-parallel group (only when its size > 1: a graph replay, NCCL
    # inside), "weights" of the trainer's weight group (always)
    collective: Literal["", "tp", "weights"] = ""
    lag: int = 0  # 1: issued in iteration i on behalf of iteration i-1 (reading the step launched before)
    held: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()
    tp_only: bool = False  # issued only when tensor parallel (size > 1)

    def __post_init__(self):
        if self.stream not in STREAMS:
            raise ValueError(f"work {self.name}: stream {self.stream!r} is not one of {STREAMS}")


@dataclass(frozen=True)
class Placement:
    """One iteration kind's works in issue order; `fresh`: buffers allocated anew each iteration."""

    name: str
    works: tuple[Work, ...]
    fresh: frozenset[str] = frozenset()

    def __getitem__(self, name: str) -> Work:
        for w in self.works:
            if w.name == name:
                return w
        raise KeyError(f"work {name!r} is not in placement {self.name!r} (it names "
                       f"{[w.name for w in self.works]})")

    def replaced(self, name: str, **changes) -> Placement:
        """This placement with work `name` changed (mutants are built this way)."""
        self[name]  # noqa: B018 (raises for an unknown name)
        works = tuple(replace(w, **changes) if w.name == name else w for w in self.works)
        return replace(self, name=f"{self.name}+{name}", works=works)

    def inserted(self, before: str, work: Work) -> Placement:
        """This placement with `work` issued just before work `before`."""
        i = self.works.index(self[before])
        return replace(self, name=f"{self.name}+{work.name}", works=(*self.works[:i], work, *self.works[i:]))

    def swapped(self, a: str, b: str) -> Placement:
        """This placement with works `a` and `b` issued in each other's place."""
        i, j = self.works.index(self[a]), self.works.index(self[b])
        works = list(self.works)
        works[i], works[j] = works[j], works[i]
        return replace(self, name=f"{self.name}~{a}~{b}", works=tuple(works))


GRAPH_INPUTS = ("ids", "positions", "slots", "seq_lens", "block_table")
_FRESH = frozenset({"tokens", "host_tokens", "eager_inputs", "received", "backup_staged",
                    "load_staged", "prefetch_staged"})

# The host-tier copies: the backups and prefetches the engine issues after the step before was launched (here at
# the start of the iteration they precede), then the schedule's loads (the radix cache issues them while
# scheduling, before the step's inputs). The pool is touched only on the compute stream (gather, scatter), in the
# step's order; the bus transfers run on side streams from and into staging tensors of their own: a backup's the
# step never waits for, a load's and a prefetch's overlapping the step in flight.
_PREFETCH = Work("tier_prefetch", "tier", "copy", "schedule", reads=("host_kv",), writes=("prefetch_staged",),
                 held=("host_kv",))
TIER = (
    Work("tier_gather", "compute", "copy", "schedule", reads=("kv",), writes=("backup_staged",)),
    Work("tier_backup", "backup", "copy", "schedule", reads=("backup_staged",), writes=("host_kv",),
         after=("tier_gather",), held=("host_kv",), unread=("host_kv",)),
    # the next waiting requests' host pages, into staging a join reads, this iteration's or a later one's (on the
    # tier stream, so the join's wait for the load after it covers it)
    _PREFETCH,
    Work("tier_load", "tier", "copy", "schedule", reads=("host_kv",), writes=("load_staged",), held=("host_kv",)),
    Work("tier_join", "compute", "copy", "schedule",
         reads=("load_staged", "backup_staged", "prefetch_staged", "prefetch_staged@-1"), writes=("kv",),
         after=("tier_load",)),
)
# The same copies direct (`engine.host_cache_copy: direct`): a backup straight from pool pages into host pages and
# a load straight from host pages into pool pages, each one kernel on the compute stream; the pages a load takes
# from prefetches' staging after the tier stream (which ran the prefetches, as above).
TIER_DIRECT = (
    Work("tier_backup_direct", "compute", "copy", "schedule", reads=("kv",), writes=("host_kv",), held=("host_kv",),
         unread=("host_kv",)),
    _PREFETCH,
    Work("tier_load_direct", "compute", "copy", "schedule", reads=("host_kv",), writes=("kv",), held=("host_kv",)),
    Work("tier_take_prefetch", "compute", "copy", "schedule", reads=("prefetch_staged", "prefetch_staged@-1"),
         writes=("kv",), after=("tier",)),
)
# A decode step through a captured CUDA graph (or the same buffers eagerly) on the compute stream; inputs and
# sampling parameters copied there from pinned memory (no host sync) into buffers every step of the size reuses,
# then the rows whose token the step in flight samples gathered from it; sampled ids copied to pinned memory
# behind an event the host reads after launching the next step.
STEP = (
    Work("step_inputs", "compute", "copy", "prepare", writes=(*GRAPH_INPUTS, "sampling")),
    Work("input_ids", "compute", "kernel", "prepare", reads=("tokens@-1",), writes=("ids",)),
    Work("replay", "compute", "replay", "forward", reads=(*GRAPH_INPUTS, "kv", "weights"),
         writes=("kv", "logits"), collective="tp"),
    Work("sample", "compute", "kernel", "forward", reads=("logits", "sampling"), writes=("tokens",)),
    Work("agree", "compute", "collective", "forward", reads=("tokens",), writes=("tokens",), collective="tp",
         tp_only=True),
    Work("copy_out", "compute", "copy", "forward", reads=("tokens",), writes=("host_tokens",)),
    Work("read_tokens", "host", "sync", "finish", reads=("host_tokens",), after=("copy_out",), lag=1),
)
# A step too large for the fixed buffers: inputs in tensors of its own (fresh), run eagerly.
EAGER_STEP = (
    Work("sampling_params", "compute", "copy", "prepare", writes=("sampling",)),
    Work("eager_inputs", "compute", "copy", "prepare", reads=("tokens@-1",), writes=("eager_inputs",)),
    Work("forward", "compute", "kernel", "forward", reads=("eager_inputs", "kv", "weights"),
         writes=("kv", "logits"), collective="tp"),
    *STEP[3:],
)
# A weight update between steps (the engine is paused): the receive on the transport's own stream (so NCCL does
# not wait for every step queued on the compute stream), the host waits for it, then copies into the parameters
# on the compute stream, behind the steps that read the old ones.
WEIGHTS = (
    Work("weights_receive", "transport", "collective", "weights", writes=("received",), collective="weights"),
    Work("weights_land", "host", "sync", "weights", after=("weights_receive",)),
    Work("weights_load", "compute", "copy", "weights", reads=("received",), writes=("weights",)),
)

# Prefill/decode disaggregation (one rank a server): a decode server writes imported KV into its pool as a command
# between steps, from the host (pageable) or by reference from the mapped prefill pool, and the host waits for it
# (its checksums are read back); a prefill server reads a finished request's KV out of its pool after applying the
# step that completed it (the host waits for the stream), or pins the pages of an export by reference as that step
# is launched, recording behind it the checksums of those its forward does not write (kv_pin).
KV_IMPORT = Work("kv_import", "compute", "sync", "schedule", writes=("kv",))
KV_EXPORT = Work("kv_export", "compute", "sync", "finish", reads=("kv",), lag=1)
KV_PIN = Work("kv_pin", "compute", "kernel", "forward", reads=("kv",))

DECODE = Placement("decode", (*TIER, *STEP), _FRESH)
EAGER = Placement("eager", (*TIER, *EAGER_STEP), _FRESH)
UPDATE = Placement("weights", WEIGHTS, _FRESH)
DECODE_SERVER = Placement("decode_server", (*TIER, KV_IMPORT, *STEP), _FRESH)
PREFILL_SERVER = Placement("prefill_server", (*TIER, *STEP[:-1], KV_PIN, STEP[-1], KV_EXPORT), _FRESH)
# the iteration kinds with a direct tier
DECODE_DIRECT, EAGER_DIRECT, DECODE_SERVER_DIRECT, PREFILL_SERVER_DIRECT = (
    Placement(f"{p.name}_direct", (*TIER_DIRECT, *p.works[len(TIER):]), p.fresh)
    for p in (DECODE, EAGER, DECODE_SERVER, PREFILL_SERVER))
IN_USE = (DECODE, EAGER, UPDATE, DECODE_SERVER, PREFILL_SERVER, DECODE_DIRECT, EAGER_DIRECT, DECODE_SERVER_DIRECT,
          PREFILL_SERVER_DIRECT)  # the iteration kinds the engine runs
# kinds only one-rank engines run (`--role` refuses --tp and --ep)
SINGLE_RANK = {DECODE_SERVER, PREFILL_SERVER, DECODE_SERVER_DIRECT, PREFILL_SERVER_DIRECT}
# The step's inputs copied on a stream of their own, done right: the copy waits for the step before's sampling,
# the last reader of those buffers (write after read), the gather and the replay wait for it (read after write).
# Accepted, not used (it buys nothing measurable: the copy is a few microseconds); the race guard's mutant arm
# runs it without its first edge.
PREP = DECODE.replaced("step_inputs", stream="prep", after=("sample@-1",)).replaced("input_ids", after=("step_inputs",))


def mutants() -> dict[str, tuple[str, Placement]]:
    """Broken placements, each with the property the checker must reject it for."""
    return {
        # a pageable host-to-device copy in preparation: the host waits for the stream, behind the last replay
        "pageable_copy": ("sync_behind_collective", DECODE.replaced("step_inputs", kind="sync")),
        # the collective moved to a stream of its own but joined back: compute still waits for it
        "collective_joined": ("sync_behind_collective", DECODE.replaced("agree", stream="collective")
                              .replaced("copy_out", after=("agree",)).replaced("step_inputs", kind="sync")),
        # the graph's inputs copied on a stream of their own, the replay waiting for them, but the copies not
        # waiting for the replay before (which still reads the same buffers)
        "prep_without_war": ("race", PREP.replaced("step_inputs", after=())),
        # the pending-token gather on the prep stream, not waiting for the tokens it reads
        "gather_without_raw": ("race", PREP.replaced("input_ids", stream="prep", after=())),
        # host-tier copies that touch the pool off the compute stream, waiting for no compute: a backup's gather
        # (the step in flight still writes its pages) and a load's scatter (the step in flight still reads pages
        # freed by a request that just finished)
        "copies_before_compute": ("race", DECODE.replaced("tier_gather", stream="backup")
                                  .replaced("tier_join", stream="tier")),
        # a load's scatter that does not wait for its transfer
        "load_not_joined": ("race", DECODE.replaced("tier_join", after=())),
        # a prefetch on a stream the load's join does not wait for
        "prefetch_on_another_stream": ("race", DECODE.replaced("tier_prefetch", stream="backup")),
        # a direct load taking pages from a prefetch's staging without waiting for the tier stream
        "direct_take_not_joined": ("race", DECODE_DIRECT.replaced("tier_take_prefetch", after=())),
        # direct copies off the compute stream, waiting for no compute (as copies_before_compute)
        "direct_before_compute": ("race", DECODE_DIRECT.replaced("tier_backup_direct", stream="backup")
                                  .replaced("tier_load_direct", stream="tier")),
        # a load that reads a host page whose backup is still in flight (not from the backup's staging)
        "load_reads_backup_in_flight": ("race", DECODE.replaced("tier_backup", unread=())),
        # parameters overwritten while the transport still receives them
        "load_before_land": ("race", UPDATE.replaced("weights_land", after=())),
        # a KV import that only queues its copy (asynchronous) from a host buffer the host refills for the next
        "import_without_wait": ("race", DECODE_SERVER.replaced("kv_import", kind="copy", reads=("kv_in",)).inserted(
            "kv_import", Work("kv_receive", "host", "kernel", "schedule", writes=("kv_in",)))),
    }


@dataclass(frozen=True)
class Violation:
    property: str
    message: str


@dataclass
class _Node:
    key: tuple  # (rank or "all", iteration, work name)
    work: Work
    iteration: int  # whose buffers it touches (issue iteration - lag)
    issued: int  # position in the rank's issue order (collectives: in the first rank's)
    collective: bool  # holds collectives in this run (one node for every rank)
    preds: set = field(default_factory=set)


def check(iterations: list[Placement] | tuple[Placement, ...], tp: int = 1,
          ranks: dict[int, list[Placement]] | None = None) -> list[Violation]:
    """The violations of the properties above when the iterations run in sequence on `tp` ranks (`ranks`: other
    iterations for some ranks)."""
    nodes: dict[tuple, _Node] = {}
    order: dict[int, list[tuple]] = {}  # rank -> node keys in issue order
    for rank in range(tp):
        order[rank] = []
        last_on: dict[str, tuple] = {}
        last_host: tuple | None = None
        for it, placement in enumerate((ranks or {}).get(rank, iterations)):
            for w in placement.works:
                if w.tp_only and tp == 1:
                    continue
                shared = (w.collective == "tp" and tp > 1) or w.collective == "weights"
                key = ("all" if shared and tp > 1 else rank, it, w.name)
                node = nodes.get(key) or nodes.setdefault(key, _Node(key, w, it - w.lag, len(order[rank]), shared))
                preds = node.preds
                if w.stream != "host" and w.stream in last_on:
                    preds.add(last_on[w.stream])
                if last_host is not None:
                    preds.add(last_host)
                for a in w.after:
                    if a in STREAMS:
                        if a in last_on:
                            preds.add(last_on[a])
                    elif (found := _instance(a, it - w.lag, w.lag, order[rank], nodes)) is not None:
                        preds.add(found)
                if w.stream != "host":
                    last_on[w.stream] = key
                if w.kind == "sync" or w.stream == "host":  # what the host does: after it in host order
                    last_host = key
                order[rank].append(key)
    reach = _closure(nodes)
    if reach is None:
        return [Violation("hang", f"the ordering graph has a cycle over {tp} ranks: a collective waits for a rank "
                                  "that waits for it")]
    found: list[Violation] = []
    for keys in order.values():
        syncs = [k for k in keys if nodes[k].work.kind == "sync"]
        for i, key in enumerate(syncs):
            node = nodes[key]
            if node.work.phase not in ("schedule", "prepare"):
                continue
            for other, onode in nodes.items():
                # (a collective an earlier host sync of this rank already waited for is known complete)
                if onode.collective and onode.iteration < node.iteration and key in reach[other] and not any(
                        k in reach[other] for k in syncs[:i]):
                    found.append(Violation("sync_behind_collective",
                                           f"{_name(node)} blocks the host behind {_name(onode)}"))
    for keys in order.values():
        found += _races(keys, nodes, reach, iterations)
    return _unique(found)


def _instance(ref: str, iteration: int, lag: int, issued: list[tuple], nodes: dict) -> tuple | None:
    """The node `ref` names for a work of `iteration`, among those issued so far: as the runtime waits, the latest
    instance (`name@-1`: of an earlier iteration); for a lagging work, which waits on events it holds, the
    instance of its own iteration."""
    name, _, back = ref.partition("@")
    found = [k for k in issued if k[2] == name]
    if back:
        found = [k for k in found if nodes[k].iteration < iteration]
    elif lag:
        found = [k for k in found if nodes[k].iteration == iteration]
    return found[-1] if found else None


def _closure(nodes: dict) -> dict | None:
    """key -> the set of keys it reaches (happens before); None if the graph has a cycle."""
    succs: dict[tuple, set] = {k: set() for k in nodes}
    for k, n in nodes.items():
        for p in n.preds:
            succs[p].add(k)
    indegree = {k: len(n.preds) for k, n in nodes.items()}
    topo, ready = [], [k for k, d in indegree.items() if d == 0]
    while ready:
        k = ready.pop()
        topo.append(k)
        for s in succs[k]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if len(topo) != len(nodes):
        return None
    reach: dict[tuple, set] = {}
    for k in reversed(topo):
        reach[k] = set().union(*({s} | reach[s] for s in succs[k])) if succs[k] else set()
    return reach


def _buffers(node: _Node, names: tuple[str, ...], fresh: frozenset) -> set[tuple]:
    out = set()
    for b in names:
        name, _, back = b.partition("@")
        it = node.iteration - (int(back[1:]) if back else 0)
        out.add((name, it if name in fresh else None))
    return out


def _races(keys: list[tuple], nodes: dict, reach: dict, iterations) -> list[Violation]:
    fresh = frozenset().union(*(p.fresh for p in iterations))
    access = []
    for k in keys:
        n = nodes[k]
        access.append((k, _buffers(n, n.work.reads, fresh), _buffers(n, n.work.writes, fresh),
                       _buffers(n, n.work.held, fresh), _buffers(n, n.work.unread, fresh)))
    found = []
    for (a, ra, wa, held, unread), (b, rb, wb, _, _) in itertools.combinations(access, 2):
        # b writing what a holds never touches the elements a does (a's references keep them); b reading what a
        # writes `unread` never reads the elements a writes
        conflict = ((wa & rb) - unread) | (((wa | ra) & wb) - held)
        if conflict and b not in reach[a] and a != b:
            buffer = sorted(conflict, key=str)[0][0]
            found.append(Violation("race", f"{_name(nodes[b])} and {_name(nodes[a])} both touch {buffer!r} "
                                           "with no ordering between them"))
    return found


def _name(node: _Node) -> str:
    rank = "every rank" if node.key[0] == "all" else f"rank {node.key[0]}"
    return f"{node.work.name} (iteration {node.key[1]}, {node.work.stream} stream, {rank})"


def _unique(found: list[Violation]) -> list[Violation]:
    return list(dict.fromkeys(found))


def check_all(placements: tuple[Placement, ...] = IN_USE, length: int = 3, tp_sizes=(1, 2, 4)) -> list[Violation]:
    """`check` over every sequence of `length` iterations drawn from `placements`, at each TP size (the
    `SINGLE_RANK` kinds at size 1 only)."""
    found = []
    for tp in tp_sizes:
        kinds = [p for p in placements if tp == 1 or p not in SINGLE_RANK]
        for seq in itertools.product(kinds, repeat=length):
            found += check(seq, tp)
    return _unique(found)
