"""An explicit-state model of the pause / load weights / continue protocol, and a breadth-first explorer of it.

Actors (what each may do in a state is `PauseModel.actions`):
- the trainer pushes versions 1..V one at a time, each as a load with a pause mode (`Engine.load_paused`) or as
  pause(mode), a load with or without a mode, resume; it awaits each command's result, and a load's result is the
  acknowledgement that the engine holds the version. Once it may also send a stale duplicate of the version before
  its newest (a retried push), which the engine must refuse.
- clients add requests and may cancel them (Abort); a request cut by an abort-mode pause is resubmitted with its
  partial output (the rollout manager) until it holds `max_tokens` tokens.
- engine rank 0 (`tandem.engine.engine`, `tandem.engine.core`) takes queued commands in order, before any step. A
  step is first taken (the thread commits to it while commands may still arrive), then launched: a token for every
  running request below `max_tokens`, the waiting requests admitted with a token each, then the previous step's
  tokens applied (overlap). Commands first apply the step in flight (drain), except a load in place, whose copies
  queue behind it. Rank 0 publishes each step and each load it accepts, and launches a step only once every
  follower applied the previous one (the step's collectives).
- tensor-parallel followers (`tandem.run.tp.run_follower`) apply the published entries in order. They apply every
  other command too, but those leave a follower's modelled state (its weight version) as it is, so the log omits
  them; a refused load is refused alike on every rank, so only accepted loads are published.
Requests share one prompt: an admitted request holds a prompt page (shared through the prefix cache when the
cache holds one) and a page of its own; a page records the weight version its KV was computed with.
`prefix_cache_max_age` is 0 (every load empties the cache), and waiting requests are admitted in index order.

Properties (`check_state` and `check_transition` name the first that fails; `explore` returns the shortest trace to it):
- `deadlock`: from every reachable state the protocol's end (every version acknowledged, the engine running, every
  request finished or cancelled, nothing queued or unapplied by a follower) is reachable without a client cancelling.
- `fresh_after_ack`: a token launched once the trainer holds the acknowledgement of version v is computed by
  weights of version >= v, and every KV page its request holds was computed with version >= v. The exception is a
  request frozen in place across a load (`Req.stale`): its own old KV stays (the documented trade-off; its tokens
  are computed, and tagged, by the new weights), but any request that is not stale and attends to such KV (through
  the cache) fails this property at its launch.
- `tokens_tagged`: every applied token carries the version of the weights that computed it (the version at launch).
- `ranks_agree`: a follower applies a step only with the weight version rank 0 launched it with.
- `kv_pages`: no page is free while a request, the cache or the step in flight uses it; a page's refcount is the
  number of its holders.
- `versions_monotone`: no rank's weight version decreases; a request's tokens' versions never decrease.
`MUTANTS` maps a change that removes one protection to the property that must catch it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

MODES = ("abort", "retract", "in_place")
NEW, INBOX, WAITING, RUNNING, DONE = "new", "inbox", "waiting", "running", "done"

MUTANTS = {
    "no_resume_after_load": "deadlock",  # a load that paused a running engine leaves it paused
    "ack_on_enqueue": "fresh_after_ack",  # the trainer counts a load as done once it is queued, not applied
    "cache_kept_on_load": "fresh_after_ack",  # a load keeps the prefix cache
    "stale_kv_shared": "fresh_after_ack",  # a request frozen in place across a load gives its KV to the cache
    "tag_at_apply": "tokens_tagged",  # a token takes the version current when it is applied, not launched
    "load_not_published": "ranks_agree",  # LoadWeights stays local to rank 0, like Snapshot
    "pause_without_drain": "kv_pages",  # a pause frees pages that the step in flight still computes on
    "older_version_accepted": "versions_monotone",  # a load of an older version is not refused
}


class Req(NamedTuple):
    status: str = NEW  # new (not submitted, or returned by an abort-mode pause) | inbox | waiting | running | done
    tokens: tuple[tuple[int, int], ...] = ()  # applied: (version it carries, version of the weights that computed it)
    pending: tuple[int, ...] = ()  # launched, not applied yet: the version of the weights computing it
    pages: tuple[int, ...] = ()  # (prompt page, own page) while admitted
    stale: bool = False  # frozen in place across a load: its KV predates the weights
    cancelled: bool = False


class Trainer(NamedTuple):
    acked: int = 0  # the newest version the engine acknowledged
    phase: str = "running"  # running | paused (its pause applied) | loaded (loaded while paused: resume next)
    waiting: bool = False  # one of its commands is queued
    retried: bool = False  # it sent its stale duplicate


class State(NamedTuple):
    reqs: tuple[Req, ...]
    pages: tuple[tuple[int, int] | None, ...]  # per page: (refcount, version its KV was computed with); None: free
    followers: tuple[tuple[int, int], ...]  # per follower: (weight version, entries of `log` applied)
    version: int = 0  # rank 0's weights
    paused: str | None = None
    stepping: bool = False  # rank 0 took a step and has not launched it yet
    cache: int | None = None  # the cached prompt page
    inflight: tuple[int, ...] = ()  # pages the launched step computes on until its tokens are applied
    inbox: tuple[tuple, ...] = ()  # commands queued for rank 0
    log: tuple[tuple[str, int], ...] = ()  # ("step" | "load", version) published, not yet applied by every follower
    trainer: Trainer = Trainer()


def command_name(cmd: tuple) -> str:
    """("add", 0) -> "add r0"; ("load", 2, None) -> "load v2"; ("pause", "abort") -> "pause abort"."""
    match cmd:
        case ("add" | "abort", i):
            return f"{cmd[0]} r{i}"
        case ("load", v, mode):
            return f"load v{v}" + (f" {mode}" if mode else "")
    return " ".join(map(str, cmd))


class PauseModel:
    """The protocol for `num_requests` requests of `max_tokens` tokens, `num_followers` TP followers, versions
    1..`num_versions`, `num_pages` KV pages (default 2 per request); `cancels`: whether clients cancel requests;
    `mutant`: a key of `MUTANTS`, or None."""

    def __init__(self, num_requests: int = 2, num_followers: int = 1, max_tokens: int = 2, num_versions: int = 2,
                 num_pages: int | None = None, cancels: bool = True, mutant: str | None = None):
        if mutant is not None and mutant not in MUTANTS:
            raise ValueError(f"mutant: must be one of {sorted(MUTANTS)}, got {mutant!r}")
        self.num_requests, self.num_followers, self.max_tokens = num_requests, num_followers, max_tokens
        self.num_versions, self.num_pages = num_versions, num_pages or 2 * num_requests
        self.cancels, self.mutant = cancels, mutant

    def initial(self) -> State:
        return State((Req(),) * self.num_requests, (None,) * self.num_pages, ((0, 0),) * self.num_followers)

    def is_end(self, s: State) -> bool:
        t = s.trainer
        return (t.acked == self.num_versions and t.phase == "running" and not t.waiting and not s.inbox
                and not s.log and not s.stepping and s.paused is None
                and all(r.status == DONE or (r.status == NEW and r.cancelled) for r in s.reqs))

    def actions(self, s: State) -> list[tuple[str, State]]:
        """Every enabled action as (label, successor)."""
        out = []
        if not s.trainer.waiting:
            out += [(f"trainer sends {command_name(c)}", self._send(s, c)) for c in self._trainer_commands(s)]
        for i, r in enumerate(s.reqs):
            if r.status == NEW and not r.cancelled and len(r.tokens) < self.max_tokens:
                out.append((f"client adds r{i}", s._replace(reqs=_set(s.reqs, i, status=INBOX),
                                                         inbox=s.inbox + (("add", i),))))
            if self.cancels and r.status in (INBOX, WAITING, RUNNING) and not r.cancelled:
                out.append((f"client cancels r{i}", s._replace(reqs=_set(s.reqs, i, cancelled=True),
                                                            inbox=s.inbox + (("abort", i),))))
        if s.inbox and not s.stepping:
            out.append((f"rank 0 applies {command_name(s.inbox[0])}", self._apply(s)))
        step_unapplied = any(kind == "step" for kind, _ in s.log)
        if (not s.inbox and not s.stepping and s.paused is None and not step_unapplied
                and any(r.status in (WAITING, RUNNING) for r in s.reqs)):
            out.append(("rank 0 takes a step", s._replace(stepping=True)))
        if s.stepping:
            out.append((f"rank 0 launches a step at v{s.version}", self._launch(s)))
        for f, (_, applied) in enumerate(s.followers):
            if applied < len(s.log):
                kind, v = s.log[applied]
                out.append((f"follower {f + 1} applies {kind} v{v}", self._follow(s, f)))
        return out

    def _trainer_commands(self, s: State) -> list[tuple]:
        t, v = s.trainer, s.trainer.acked + 1
        if t.phase == "paused":
            return [("load", v, None)] + [("load", v, m) for m in MODES]
        if t.phase == "loaded":
            return [("resume",)]
        cmds = [("load", v, m) for m in MODES] + [("pause", m) for m in MODES] if v <= self.num_versions else []
        if not t.retried and t.acked >= 1:
            cmds.append(("load", t.acked - 1, "retract"))
        return cmds

    def _send(self, s: State, cmd: tuple) -> State:
        t = s.trainer._replace(waiting=True)
        if cmd[0] == "load" and cmd[1] < t.acked:
            t = t._replace(retried=True)
        elif cmd[0] == "load" and self.mutant == "ack_on_enqueue":
            t = t._replace(acked=cmd[1])
        return s._replace(trainer=t, inbox=s.inbox + (cmd,))

    def _apply(self, s: State) -> State:
        e, cmd, t = _Rank0(self, s), s.inbox[0], s.trainer
        match cmd:
            case ("add", i):
                e.set(i, status=WAITING)
            case ("abort", i):
                e.drain()
                if e.reqs[i].status in (WAITING, RUNNING):
                    e.finish(i, DONE)
            case ("pause", mode):
                if self.mutant != "pause_without_drain":
                    e.drain()
                e.pause(mode)
                t = t._replace(waiting=False, phase="paused")
            case ("resume",):
                e.drain()
                e.paused = None
                t = t._replace(waiting=False, phase="running")
            case ("load", v, mode):
                if e.load(v, mode):
                    t = t._replace(acked=e.version, phase="loaded" if t.phase == "paused" else t.phase)
                t = t._replace(waiting=False)
        return e.state(inbox=s.inbox[1:], trainer=t)

    def _launch(self, s: State) -> State:
        e, inflight = _Rank0(self, s), []
        previous = [len(r.pending) for r in s.reqs]
        for i in e.ids(RUNNING):
            r = e.reqs[i]
            if len(r.tokens) + len(r.pending) < self.max_tokens:
                e.set(i, pending=r.pending + (e.version,))
                inflight += r.pages
        for i in e.ids(WAITING):
            if e.reqs[i].pending:  # retracted with its token in flight: admitted once that token is applied
                continue
            if not e.admit(i):
                break  # in order: nobody overtakes a request that does not fit
            e.set(i, status=RUNNING, pending=(e.version,))
            inflight += e.reqs[i].pages
        for i, n in enumerate(previous):
            if n:
                e.resolve(i, n)
        e.inflight = tuple(sorted(set(inflight)))
        e.log += (("step", e.version),)
        return e.state(stepping=False)

    def _follow(self, s: State, f: int) -> State:
        version, applied = s.followers[f]
        kind, v = s.log[applied]
        followers = s.followers[:f] + ((v if kind == "load" else version, applied + 1),) + s.followers[f + 1:]
        done = min(a for _, a in followers)  # entries every follower applied leave the log
        return s._replace(followers=tuple((ver, a - done) for ver, a in followers), log=s.log[done:])


def _set(reqs: tuple[Req, ...], i: int, **changes) -> tuple[Req, ...]:
    return reqs[:i] + (reqs[i]._replace(**changes),) + reqs[i + 1:]


class _Rank0:
    """Rank 0's state made mutable for one transition; the methods are `EngineCore`'s and `Scheduler`'s."""

    def __init__(self, model: PauseModel, s: State):
        self.m, self.s = model, s
        self.reqs, self.pages = list(s.reqs), list(s.pages)
        self.version, self.paused, self.cache, self.inflight, self.log = s.version, s.paused, s.cache, s.inflight, s.log

    def state(self, **changes) -> State:
        return self.s._replace(reqs=tuple(self.reqs), pages=tuple(self.pages), version=self.version,
                       paused=self.paused, cache=self.cache, inflight=self.inflight, log=self.log, **changes)

    def set(self, i: int, **changes) -> None:
        self.reqs[i] = self.reqs[i]._replace(**changes)

    def ids(self, *statuses: str) -> list[int]:
        return [i for i, r in enumerate(self.reqs) if r.status in statuses]

    def incref(self, page: int) -> None:
        count, kv = self.pages[page]
        self.pages[page] = (count + 1, kv)

    def decref(self, page: int) -> None:
        count, kv = self.pages[page]
        self.pages[page] = (count - 1, kv) if count > 1 else None

    def alloc(self) -> int:
        page = self.pages.index(None)
        self.pages[page] = (1, self.version)
        return page

    def admit(self, i: int) -> bool:
        """Give request i its pages, sharing the cached prompt page; evict that page if only the cache holds it
        and pages are short. False: they do not fit."""
        need = 1 if self.cache is not None else 2
        if self.pages.count(None) < need and self.cache is not None and self.pages[self.cache][0] == 1:
            self.empty_cache()
            need = 2
        if self.pages.count(None) < need:
            return False
        if self.cache is None:  # its prefill publishes its prompt page to the cache
            self.cache = self.alloc()
        self.incref(self.cache)
        self.set(i, pages=(self.cache, self.alloc()))
        return True

    def resolve(self, i: int, n: int) -> None:
        """Apply request i's oldest `n` launched tokens (`Scheduler.resolve`); it ends at `max_tokens`."""
        r = self.reqs[i]
        tag = (lambda w: self.version) if self.m.mutant == "tag_at_apply" else (lambda w: w)
        self.set(i, tokens=r.tokens + tuple((tag(w), w) for w in r.pending[:n]), pending=r.pending[n:])
        if len(self.reqs[i].tokens) >= self.m.max_tokens:
            self.finish(i, DONE)

    def drain(self) -> None:
        for i, r in enumerate(self.reqs):
            if r.pending:
                self.resolve(i, len(r.pending))
        self.inflight = ()

    def release(self, i: int) -> None:
        """Drop request i's pages; its KV goes to the cache unless it is stale (`Scheduler.release`)."""
        r = self.reqs[i]
        if r.pages and self.cache is None and (not r.stale or self.m.mutant == "stale_kv_shared"):
            self.cache = r.pages[0]
            self.incref(self.cache)
        for page in r.pages:
            self.decref(page)
        self.set(i, pages=())

    def finish(self, i: int, status: str) -> None:
        """End request i (`status` NEW: returned by an abort-mode pause, to be resubmitted); a token still in
        flight is dropped."""
        self.release(i)
        self.set(i, status=status, pending=(), stale=False)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            for i in self.ids(WAITING, RUNNING):
                self.finish(i, NEW)
        elif mode == "retract":
            for i in self.ids(RUNNING):
                self.release(i)
                self.set(i, status=WAITING, stale=False)
        self.paused = mode

    def mark_stale(self) -> None:
        for i in self.ids(RUNNING):
            self.set(i, stale=True)

    def empty_cache(self) -> None:
        if self.cache is not None:
            self.decref(self.cache)
            self.cache = None

    def load(self, v: int, mode: str | None) -> bool:
        """`EngineCore._load_weights`: False when refused (nothing changes)."""
        if (v < self.version and self.m.mutant != "older_version_accepted") or (mode is None and self.paused is None):
            return False
        pausing = mode is not None and self.paused is None
        if mode != "in_place":
            self.drain()
        if pausing:
            self.mark_stale()  # a retract or abort must not cache KV of the weights replaced
            self.pause(mode)
        self.mark_stale()
        if self.m.mutant != "cache_kept_on_load":
            self.empty_cache()
        self.version = v
        if self.m.mutant != "load_not_published":
            self.log += (("load", v),)
        if pausing and self.m.mutant != "no_resume_after_load":
            self.paused = None
        return True


# ---- the properties ------------------------------------------------------------------------------------------
def check_state(s: State) -> str | None:
    """The first property of a state (`kv_pages`, `tokens_tagged`, the version order of each request's tokens)
    that `s` violates, or None."""
    holders = [0] * len(s.pages)
    for r in s.reqs:
        for page in r.pages:
            holders[page] += 1
        versions = [tag for tag, _ in r.tokens] + list(r.pending)
        if versions != sorted(versions):
            return "versions_monotone"
    if s.cache is not None:
        holders[s.cache] += 1
    if any(n != (entry[0] if entry else 0) for n, entry in zip(holders, s.pages, strict=True)) \
            or any(s.pages[page] is None for page in s.inflight):
        return "kv_pages"
    if any(tag != computed for r in s.reqs for tag, computed in r.tokens):
        return "tokens_tagged"
    return None


def check_transition(pre: State, post: State) -> str | None:
    """The first property of the transition `pre` -> `post` (`versions_monotone` across ranks, `ranks_agree`,
    `fresh_after_ack`) that it violates, or None."""
    if post.version < pre.version:
        return "versions_monotone"
    if post.followers is not pre.followers:
        for (version, applied), (version_after, applied_after) in zip(pre.followers, post.followers, strict=True):
            if version_after < version:
                return "versions_monotone"
            if len(post.log) - applied_after < len(pre.log) - applied:  # this follower applied pre.log[applied]
                kind, v = pre.log[applied]
                if kind == "step" and v != version:
                    return "ranks_agree"
    if post.reqs is not pre.reqs:
        acked = pre.trainer.acked
        for a, b in zip(pre.reqs, post.reqs, strict=True):
            launched = len(b.tokens) + len(b.pending) > len(a.tokens) + len(a.pending)
            if launched and (b.pending[-1] < acked
                             or (not b.stale and any(post.pages[p][1] < acked for p in b.pages))):
                return "fresh_after_ack"
    return None


@dataclass(frozen=True)
class Counterexample:
    prop: str
    trace: tuple[str, ...]  # the actions from the initial state
    state: State  # the state reached

    def __str__(self) -> str:
        return f"{self.prop} violated after {len(self.trace)} actions:\n  " + "\n  ".join(self.trace)


@dataclass(frozen=True)
class Exploration:
    num_states: int
    num_transitions: int
    counterexample: Counterexample | None


def explore(model: PauseModel, max_states: int = 2_000_000) -> Exploration:
    """Enumerate every reachable state breadth first, checking each transition; then check that the end stays
    reachable from every state. Returns the shortest counterexample found (transition properties first); a
    deadlock's trace goes to the first state that cannot reach the end, then on until nothing new can happen."""
    start = model.initial()
    index, states, parent = {start: 0}, [start], [(-1, "")]
    to_end: list[list[int]] = [[]]  # reversed edges of actions other than a client cancelling
    num_transitions = 0
    queue = deque([0])
    while queue:
        k = queue.popleft()
        for label, succ in model.actions(states[k]):
            num_transitions += 1
            if (j := index.get(succ)) is None:
                if len(states) >= max_states:
                    raise RuntimeError(f"more than {max_states} states: explore smaller sizes")
                j = index[succ] = len(states)
                states.append(succ)
                parent.append((k, label))
                to_end.append([])
                queue.append(j)
                prop = check_transition(states[k], succ) or check_state(succ)
            else:
                prop = check_transition(states[k], succ)
            if prop is not None:
                trace = _trace(parent, k) + (label,)
                return Exploration(len(states), num_transitions, Counterexample(prop, trace, succ))
            if not label.startswith("client cancels"):
                to_end[j].append(k)
    reaches_end = [model.is_end(s) for s in states]
    frontier = deque(k for k, end in enumerate(reaches_end) if end)
    while frontier:
        for k in to_end[frontier.popleft()]:
            if not reaches_end[k]:
                reaches_end[k] = True
                frontier.append(k)
    stuck = next((k for k, ok in enumerate(reaches_end) if not ok), None)  # BFS order: the shortest trace
    if stuck is None:
        return Exploration(len(states), num_transitions, None)
    # run on from there (every state after it is stuck too) until no action is left or it would revisit a state
    trace, s, seen = list(_trace(parent, stuck)), states[stuck], {states[stuck]}
    while nexts := [(label, t) for label, t in model.actions(s)
                    if not label.startswith("client cancels") and t not in seen]:
        label, s = nexts[0]
        trace.append(label)
        seen.add(s)
    return Exploration(len(states), num_transitions, Counterexample("deadlock", tuple(trace), s))


def _trace(parent: list[tuple[int, str]], k: int) -> tuple[str, ...]:
    labels = []
    while k > 0:
        k, label = parent[k]
        labels.append(label)
    return tuple(reversed(labels))


def replay(model: PauseModel, labels: list[str], start: State | None = None) -> tuple[State, Counterexample | None]:
    """Follow `labels` from `start` (default: the initial state). Returns the state reached and None, or a
    counterexample: a label that is no enabled action ("not_an_action", the trace ending with it) or a property that
    fails (the trace of `labels` up to it)."""
    s, done = start or model.initial(), []
    for label in labels:
        succ = dict(model.actions(s)).get(label)
        if succ is None:
            return s, Counterexample("not_an_action", (*done, label), s)
        done.append(label)
        if (prop := check_transition(s, succ) or check_state(succ)) is not None:
            return succ, Counterexample(prop, tuple(done), succ)
        s = succ
    return s, None
