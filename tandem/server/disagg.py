"""Prefill/decode disaggregation between `tandem serve --role prefill` and `--role decode` servers, over HTTP.

The protocol is tandem's own (SGLang pairs its servers through a bootstrap port and moves KV by RDMA); this module
holds what both ends share and the decode server's end (`PrefillClient`), `disagg_prefill` the prefill server's:
- `GET /pd/info` on every server: its role, KV layout (page size, dtype, layers, KV heads, head dim), model config
  and weight version (`kv_layout`); a prefill server's also its `transfer`: the transfers it offers, where its KV
  can be shared (`kv_transfer.sharing_domain`) and how many exports it holds (`held`).
- A decode server's `/generate` may carry `bootstrap: {"prefill_url": URL}` (a router adds it). For each prompt
  the decode server then goes through these states:
  bootstrapping: it pairs with URL once (`/pd/info`; any difference in layout, model or weight version refuses the
  pairing with a message naming the field; so does a transfer that cannot be made, naming why) and asks its
  engine which leading whole pages of the prompt it already holds (`Engine.probe`, which also makes the engine
  expect the import);
  waiting: it POSTs `/pd/prefill` (the prompt, the sampling parameters with the seed it chose, `kv_from`,
  `transfer`) and the prefill server computes the prompt and samples the first token;
  transferring: the answer's header carries the first token, logprob and weight version, its body the KV of
  positions [kv_from, prompt length) (`KVPages`, a checksum per page) as the transfer asked for (below);
  done: the engine imports both (`Engine.generate_imported`) and decodes on;
  failed: the prefill server was unreachable, failed, timed out or sent KV that does not verify: the request ends
  with an abort naming the server and the cause, and the engine forgets it (nothing was written into its pool).
A pause on the decode server holds imports that arrive during it (nothing is written until it continues); a pause in
mode abort ends them, as it ends running requests; a pause in mode retract hands its running requests back (and an
import whose KV is of other weights than it holds): `PrefillClient` then has the prefill server compute the prompt
and the tokens so far again under the weights held now (`prompt_len` in `/pd/prefill`: sampling continues at the
request's position), and the client sees one answer. Where both servers keep routed experts (routing replay) the
KV carries them (`KVPages.routing`).

The three transfers (`PrefillClient(transfer=...)`; by default reference where the pairing allows it, else point to
point where it allows that, else bytes), each verified on the decode server's device before its engine writes:
- "bytes": the body is `KVPages.to_bytes()` (application/octet-stream). Nothing is held after the answer.
- "reference" (servers of one host, KV on the same kind of device; on CUDA also two processes, the prefill
  server's GPU visible to the decode server; a prefill server of one rank, its pool on a GPU or, on a CPU, in
  shared memory): at pairing the decode server maps the prefill server's whole KV pool once (`GET /pd/pool`,
  `kv_mapped.MappedPool`: CUDA IPC, or the pool's shared-memory file; with the checksum records its forward keeps,
  `KVPool(slot_sums=True)`, and its pages' epochs) and keeps it until it unpairs. The prefill engine pins the
  request's pages (no page is freed or reused while they are pinned); the body is JSON `{"id": ..., "kv": handle}`
  naming the pages and their epochs (`kv_mapped.PinnedKV`): no checksum is computed or sent. The decode server
  writes them into pages its engine set aside for the request when it was probed, in one pass from the mapping as
  the answer lands, checksumming what it read and summing the prefill side's checksums from the mapped records
  (`Engine.write_reserved`), then compares both and the pages' epochs (`kv_mapped.MappedKV.check`); only then does
  its engine take the request, with the pages. Where none were set aside, or the engine is paused or holds other
  weights, its engine writes them as it places the import (`MappedKV.write_into`). On a difference the request
  ends with an abort naming the page and the pages written are freed. Where the prefill server offers it
  (`/pd/info`'s `mailbox`), the decode server opens a mailbox (`disagg_mailbox`: a Unix socket) and names it in its
  `/pd/prefill`; the prefill engine then mails the pages as it pins them (as it launches the step that computes them)
  and says they are ready once it has that step's result, so the decode server parses them while the prefill computes
  and writes and checks them as the ready mail lands, before the answer has come; the answer must then name the same
  pages under the same weight version (else an abort), and the rest goes as above. With `engine.kv_doorbells` (a
  GPU) the decode server also names a doorbell (`tandem.engine.doorbell`) and queues the pass as the pages mail
  lands, behind a stream wait on it (`Engine.arm_reserved`); the prefill engine rings it once it has the step's
  result, before its ready mail, so the device runs the pass then and the ready mail only has the host take the
  sums and compare them (a bell the prefill server cannot ring the decode server rings as the ready mail lands).
  Once the engine wrote the import or dropped it (or the request ended), the decode server POSTs `/pd/release {"id":
  ...}`, which unpins the pages; an export nobody releases within `disagg_prefill.RELEASE_TIMEOUT_S` of its answer (a
  decode server that died) is unpinned then, and a decode server that reads those pages later finds them handed out
  again (their epochs changed): it never keeps what it read.
- "p2p" (both KV on CPUs, or on two different GPUs: `kv_p2p`): at pairing the decode server POSTs `/pd/p2p/open`
  and both build their end of a two-rank group (gloo or NCCL) through a store the prefill server hosts; the
  `/pd/prefill` request names the `link`, the body is JSON `{"id": ..., "kv": header}`, and the prefill server
  holds the KV (as for a reference, with the same timeout) until the decode server, having taken the link's turn
  and started receiving, POSTs `/pd/p2p/send {"id", "link"}`, which sends it and frees it. A send or receive that
  fails or outlasts `kv_p2p.P2P_TIMEOUT_S` (a server that died) breaks the link at both ends; the request ends
  with an abort and the decode server pairs anew on its next request.

`GET /pd/transfers` on a decode server: its latest transfers, each timed by itself (`PrefillClient._record`): the
prefill server's export, the take (received, copied, verified; by reference nothing), the write into the pool
(device time; by reference the one pass), and the whole import from the answer to the pages written (by reference
checked too); by reference also the hop to the engine's thread (`queue_s`) and the wait for the pass and the
comparison (`check_s`) (`disagg_import`: the decode server's end after the answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
import uuid
from typing import Literal
from urllib.parse import urlparse

import aiohttp
from fastapi import FastAPI

from tandem.engine.doorbell import Doorbells
from tandem.engine.engine import Engine
from tandem.engine.kv_mapped import MappedKV, MappedPool
from tandem.engine.kv_p2p import P2P_TIMEOUT_S, P2PLink, join_store, why_not_p2p
from tandem.engine.kv_transfer import KVPages, TransferClock, sharing_domain, why_not_shared, wire_meta
from tandem.server.disagg_import import KVImports, Mail, _verify, records
from tandem.server.disagg_mailbox import DOORBELL_HEADER, MAIL_KEY_HEADER, MAILBOX_HEADER, Mailbox
from tandem.server.disagg_prefill import HEADER, Exports, add_prefill_routes, offered
from tandem.types import HANDED_BACK, FinishReason, GenerateOutput, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["HEADER", "Exports", "PrefillClient", "add_routes", "kv_layout"]  # (a prefill server's end: disagg_prefill)
PREFILL_TIMEOUT_S = 300.0  # a prefill server that has not answered a prompt by then has failed it
Transfer = Literal["bytes", "reference", "p2p"]


def kv_layout(engine: Engine, role: str | None = None) -> dict:
    """What a decode server and its prefill server must agree on, and the role (`role`, or the engine's)."""
    pool = engine.pool
    return {"role": role or engine.config.role, "page_size": pool.page_size,
            "kv_dtype": str(pool.k_cache.dtype).removeprefix("torch."),
            "num_layers": pool.k_cache.shape[0], "num_kv_heads": pool.k_cache.shape[2],
            "head_dim": pool.k_cache.shape[3], "model": dataclasses.asdict(engine.model_config),
            "weight_version": engine.weight_version, "routed_experts": pool.routing is not None}


def add_routes(app: FastAPI, engine: Engine, until_disconnected) -> None:
    """`/pd/info` on every server, `/pd/transfers` (a decode server's), and a prefill server's own routes
    (`disagg_prefill`; `until_disconnected(request, coro)`: the server's way of aborting a request whose client went
    away)."""
    role = engine.config.role
    device = engine.pool.k_cache.device
    kinds, exports = offered(engine), Exports()

    @app.get("/pd/transfers")
    async def transfers():
        """A decode server's latest KV transfers, oldest first (`PrefillClient`'s records)."""
        return records(engine)

    @app.get("/pd/info")
    async def info():
        if role != "prefill":
            return kv_layout(engine)
        return kv_layout(engine) | {"transfer": {"kinds": kinds, "sharing": sharing_domain(device),
                                                 "held": len(exports), "mailbox": "reference" in kinds}}

    if role == "prefill":
        add_prefill_routes(app, engine, until_disconnected, kinds, exports)


class PrefillClient(KVImports):
    """A decode server's way through prefill servers (see the module docstring). `transfer`: how it takes their KV;
    None: by reference from a prefill server it can take it from so, else as bytes."""

    def __init__(self, engine: Engine, timeout_s: float = PREFILL_TIMEOUT_S, transfer: Transfer | None = None):
        if transfer not in (None, "bytes", "reference", "p2p"):
            raise ValueError(f"transfer: must be 'bytes', 'reference', 'p2p' or None (the best), got {transfer!r}")
        self.engine, self.timeout_s, self.transfer = engine, timeout_s, transfer
        self.paired: dict[str, Transfer] = {}  # prefill server URL -> the transfer from it
        self.links: dict[str, tuple[str, P2PLink, asyncio.Lock]] = {}  # URL -> link id, this end, its turn
        self.pools: dict[str, MappedPool] = {}  # URL -> its KV pool, mapped while paired by reference
        self.mailing: set[str] = set()  # URLs paired by reference that mail their exports (`disagg_mailbox`)
        self.mailbox: Mailbox | None = None  # (started at the first such pairing)
        self.bells: Doorbells | None = None  # (with the mailbox, where `kv_doorbells` asks and the device has them)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        for url in list(self.links) + list(self.pools):
            self._unpair(url)
        if self.mailbox is not None:
            await self.mailbox.close()
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def pair(self, url: str) -> None:
        """Check once that `url` is a prefill server this one can take KV from, and choose the transfer; ValueError
        naming what differs, or why the transfer asked for cannot be made. By reference it maps the prefill server's
        pool now; where that fails, a transfer not asked for falls back to bytes (logged)."""
        if url in self.paired:
            return
        try:
            async with self._http().get(f"{url}/pd/info") as r:
                if r.status != 200:
                    raise ValueError(f"bootstrap.prefill_url: {url}/pd/info answered {r.status}")
                theirs = await r.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ValueError(f"bootstrap.prefill_url: {url} is unreachable ({type(e).__name__}: {e})") from None
        mine = json.loads(json.dumps(kv_layout(self.engine, "prefill")))  # (as JSON gives it: lists, not tuples)
        mine |= {f"model.{k}": v for k, v in mine.pop("model").items()}
        theirs |= {f"model.{k}": v for k, v in (theirs.pop("model", None) or {}).items()}
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise ValueError(f"bootstrap.prefill_url: {url} cannot pair with this decode server: its {key} is "
                                 f"{theirs.get(key)!r}, this server's {value!r}")
        transfer = self._choose(url, theirs.get("transfer") or {})
        if transfer == "p2p":
            self.links[url] = await self._open_link(url)
        elif transfer == "reference":
            try:
                self.pools[url] = await self._map_pool(url)
            except ValueError as e:
                if self.transfer is not None:  # (asked for: refuse, naming why)
                    raise
                log.warning("decode server: takes KV from %s as bytes: %s", url, e)
                transfer = "bytes"
            else:
                if (theirs.get("transfer") or {}).get("mailbox") and await self._open_mailbox():
                    self.mailing.add(url)
        self.paired[url] = transfer

    async def _open_mailbox(self) -> bool:
        """Whether this server's mailbox listens (started now if not yet; a failure is logged: no mail then)."""
        if self.mailbox is None:
            mailbox = Mailbox()
            try:
                await mailbox.start()
            except OSError as e:
                log.warning("decode server: no mailbox (%s: %s); KV by reference takes the answer's way",
                            type(e).__name__, e)
                return False
            self.mailbox = mailbox
            if self.engine.config.kv_doorbells:
                self.bells = await asyncio.to_thread(Doorbells.open, self.engine.pool.k_cache.device)
        return True

    def _unpair(self, url: str) -> None:
        """Forget `url`'s pairing and break its link (after a failed transfer): the next request pairs anew."""
        self.paired.pop(url, None)
        self.mailing.discard(url)
        self.pools.pop(url, None)  # (imports still on their way keep what they read mapped)
        if (link := self.links.pop(url, None)) is not None:
            link[1].close()

    def _choose(self, url: str, theirs: dict) -> Transfer:
        """The transfer from a prefill server whose `/pd/info` says `theirs` about its transfers: the one asked for,
        else by reference where it can, else point to point where it can, else bytes."""
        device, kinds, sharing = self.engine.pool.k_cache.device, theirs.get("kinds", ["bytes"]), theirs.get("sharing")
        why_not = {"bytes": None,
                   "reference": why_not_shared(sharing or {}, device) if "reference" in kinds else f"it offers {kinds}",
                   "p2p": why_not_p2p(sharing or {}, device) if "p2p" in kinds else f"it offers {kinds}"}
        if self.transfer is not None and why_not[self.transfer] is not None:
            raise ValueError(f"bootstrap.prefill_url: this decode server takes KV by {self.transfer}, and cannot from "
                             f"{url}: {why_not[self.transfer]}")
        return self.transfer or next(kind for kind in ("reference", "p2p", "bytes") if why_not[kind] is None)

    async def _map_pool(self, url: str) -> MappedPool:
        """The KV pool of the prefill server at `url`, mapped here (`kv_mapped`); ValueError if it cannot be."""
        try:
            async with self._http().get(f"{url}/pd/pool") as r:
                if r.status != 200:
                    raise ValueError(f"answered {r.status}: {(await r.read())[:300].decode(errors='replace')}")
                handle = await r.json()
            return await asyncio.to_thread(MappedPool, handle, self.engine.pool.k_cache.device)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ValueError(f"bootstrap.prefill_url: the KV pool of {url} cannot be mapped ({type(e).__name__}: "
                             f"{e})") from None

    async def _open_link(self, url: str) -> tuple[str, P2PLink, asyncio.Lock]:
        """A point-to-point link with the prefill server at `url` (this end rank 1); ValueError if none can be made."""
        try:
            async with self._http().post(f"{url}/pd/p2p/open") as r:
                if r.status != 200:
                    raise ValueError(f"answered {r.status}: {(await r.read())[:300].decode(errors='replace')}")
                answer = await r.json()
            store = await asyncio.to_thread(join_store, urlparse(url).hostname, int(answer["port"]), P2P_TIMEOUT_S)
            link = await asyncio.to_thread(P2PLink, store, 1, self.engine.pool.k_cache.device, P2P_TIMEOUT_S)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"bootstrap.prefill_url: no point-to-point link with {url} ({type(e).__name__}: "
                             f"{e})") from None
        return answer["id"], link, asyncio.Lock()

    async def generate_all(self, jobs: list[tuple[list[int], SamplingParams, str]], url: str,
                           routed: list[bool] | None = None) -> list[GenerateOutput]:
        """Each job (input ids, sampling, rid) through the prefill server at `url`, concurrently, outputs in order
        (`routed`: which return their routed experts). Cancelling this coroutine aborts them all."""
        await self.pair(url)
        routed = routed or [False] * len(jobs)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._one(*job, url, flag)) for job, flag in zip(jobs, routed, strict=True)]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _one(self, input_ids: list[int], sampling: SamplingParams, rid: str, url: str,
                   routed: bool = False) -> GenerateOutput:
        """One request through `url`, again after each hand-back (`HANDED_BACK`: its prompt and what it generated
        so far computed there under the weights held now)."""
        if sampling.seed is None:  # the prefill server samples the first token, this engine the rest: one seed
            sampling = dataclasses.replace(sampling, seed=random.getrandbits(63))
        self.engine.validate(input_ids, sampling, rid)  # (once: not on the way of each transfer)
        so_far = GenerateOutput(rid, [], [], [], FinishReason("abort", message=HANDED_BACK), len(input_ids), 0)
        prefilled = retractions = 0
        while so_far.finish_reason.message == HANDED_BACK:
            history = input_ids + so_far.output_ids
            kv_from = await self.engine.probe(history, rid, reserve=self.paired.get(url) == "reference")
            try:
                await self.pair(url)  # (again if a failed transfer broke the pairing)
                sampled, kv, meta = await self._prefill(url, history, sampling, rid, kv_from, len(input_ids))
                if isinstance(kv, MappedKV):
                    await self._write_landed(url, rid, kv, sampled[2])
            except BaseException as e:
                self.engine.abort(rid)  # it expected the import: forget it
                if isinstance(e, asyncio.CancelledError):
                    raise
                message = f"prefill server {url} failed: {type(e).__name__}: {e}"
                return dataclasses.replace(so_far, finish_reason=FinishReason("abort", message=message))
            if not prefilled:  # what the prompt cost: the prefill server's cache hits
                so_far.cached_tokens = meta["cached_tokens"]
            prefilled += meta["prefill_tokens"]
            if sampled is None:  # the prefill server ended it (an abort there: a pause, a flush)
                self.engine.abort(rid)
                return dataclasses.replace(so_far, finish_reason=FinishReason(**meta["finish_reason"]))
            generated = [[*mine, theirs] for mine, theirs in zip(
                (so_far.output_ids, so_far.output_logprobs, so_far.weight_versions), sampled, strict=True)]
            generating = asyncio.ensure_future(self.engine.generate_imported(
                input_ids, sampling, tuple(generated), kv, rid, routed, validated=True))
            if isinstance(kv, MappedKV):  # (released once written, or dropped: the request may decode on long)
                releasing = asyncio.ensure_future(self._release_settled(url, kv, generating))
            try:
                out = await asyncio.shield(generating)
            except asyncio.CancelledError:
                generating.cancel()  # (which aborts it in the engine)
                raise
            finally:
                if isinstance(kv, MappedKV):
                    await asyncio.shield(releasing)
            self._record(rid, kv, meta)
            retractions += out.finish_reason.message == HANDED_BACK
            so_far = dataclasses.replace(out, cached_tokens=so_far.cached_tokens)
        so_far.prefill_tokens, so_far.num_retractions = prefilled, so_far.num_retractions + retractions
        return so_far

    async def _prefill(self, url, input_ids, sampling, rid, kv_from, prompt_len):
        """`/pd/prefill` at `url`: (first token, KV, the answer's meta). By reference with a mailbox, the KV may
        come by mail first, written and checked as it lands (`_mailed`), the answer confirming it (`_confirm`)."""
        if (transfer := self.paired.get(url)) is None or (transfer == "p2p" and url not in self.links):
            raise RuntimeError("its pairing broke while this request waited (another transfer failed)")
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": dataclasses.asdict(sampling), "kv_from": kv_from,
                "prompt_len": prompt_len, "transfer": transfer}
        if transfer == "p2p":
            body["link"] = self.links[url][0]
        headers, mail = {}, None
        if transfer == "reference" and url in self.mailing and self.mailbox is not None \
                and self.engine.pool.routing is None:  # (routed experts come with the answer alone)
            key = f"{rid}#{uuid.uuid4().hex[:12]}"  # (this attempt's: a late mail of an earlier one is not taken)
            headers |= {MAILBOX_HEADER: self.mailbox.name, MAIL_KEY_HEADER: key}
            mail = Mail(self.bells.take(self.timeout_s + 5) if self.bells is not None else None)
            if mail.bell is not None:
                headers[DOORBELL_HEADER] = mail.bell.spec
            mail.pages = self.mailbox.expect(key, "pages", functools.partial(self._mailed, url, rid, mail))
            mail.ready = self.mailbox.expect(key, "ready", functools.partial(self._mail_ready, url, rid, mail))
        try:
            r = await self._http().post(f"{url}/pd/prefill", json=body, headers=headers)
        except BaseException:
            if mail is not None:
                mail.done()
            raise
        try:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"answered {r.status}: {data[:300].decode(errors='replace')}")
            meta = json.loads(r.headers[HEADER])
            if meta["first"] is None:
                return None, None, meta
            clock = TransferClock(self.engine.pool.k_cache.device)
            clock.mark("import", device=False)
            meta["transfer"] = transfer
            if transfer == "bytes":  # (verified on this engine's device, where the write reads it)
                kv = await asyncio.to_thread(lambda: KVPages.from_bytes(data, wire_meta(data)).to(
                    self.engine.pool.k_cache.device))  # (parsed and copied off the event loop)
                clock.mark("taken")
                await asyncio.to_thread(_verify, kv)
                clock.mark("verified")
            elif transfer == "p2p":
                kv = await self._receive(url, data, clock)
            elif mail is not None and (kv := mail.kv) is not None:  # (written as its mail landed)
                await self._confirm(url, data, kv, meta)
                clock = kv.clock
            else:
                kv = await self._take(url, data, clock, meta)
            problem, token, vocab = None, meta["first"][0], self.engine.model_config.vocab_size
            if kv.start != kv_from or kv.end != len(input_ids):
                problem = f"sent positions [{kv.start}, {kv.end}), asked for [{kv_from}, {len(input_ids)})"
            elif type(token) is not int or not 0 <= token < vocab:  # (else it would fail this engine's whole step)
                problem = f"sent token {token!r}, not a token id in [0, {vocab})"
            if problem is not None:
                if isinstance(kv, MappedKV):  # (never to be written: its pages go back now)
                    await asyncio.shield(self._release(url, kv.export_id))
                raise ValueError(problem)
            return meta["first"], kv.with_clock(clock), meta
        finally:
            if mail is not None:
                mail.done()  # (the answer's way was taken, or the mail's is done: no mail is wanted now)
            r.release()
