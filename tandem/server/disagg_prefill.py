"""The prefill server's end of prefill/decode disaggregation (`tandem.server.disagg` states the protocol):
`/pd/prefill`, `/pd/release`, `/pd/p2p/open` and `/pd/p2p/send`, and the KV exports it holds for decode servers
(`Exports`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
import weakref

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.engine.engine import Engine
from tandem.engine.kv_mapped import PinnedKV, pool_handle, why_not_mappable
from tandem.engine.kv_p2p import P2P_TIMEOUT_S, P2PExport, P2PLink, backend_for, host_store
from tandem.server.bodies import P2PSendBody, PrefillBody, ReleaseBody
from tandem.server.disagg_mailbox import DOORBELL_HEADER, MAIL_KEY_HEADER, MAILBOX_HEADER, MailSender
from tandem.types import SamplingParams

log = logging.getLogger(__name__)

HEADER = "X-Tandem-Prefill"  # the answer's header: the first token and what the prefill server spent on it
RELEASE_TIMEOUT_S = 60.0  # a prefill server frees an export not released by then (its decode server died)


def offered(engine: Engine) -> list[str]:
    """The transfers a prefill server offers: bytes; by reference where its pool can be mapped (on a GPU, or in
    shared memory on a CPU; its checksum records and its pages' epochs too) and pinned (one rank); point to point
    where its device has a backend."""
    device = engine.pool.k_cache.device
    mappable = engine.tp.size == 1 and why_not_mappable(engine.pool) is None
    return ["bytes", *(["reference"] if mappable else []), *(["p2p"] if backend_for(device) else [])]


def add_prefill_routes(app: FastAPI, engine: Engine, until_disconnected, kinds: list[str], exports: Exports) -> None:
    """The prefill server's routes (`until_disconnected(request, coro)`: the server's way of aborting a request whose
    client went away; `kinds`: the transfers it offers; `exports`: what it holds)."""
    device = engine.pool.k_cache.device
    links: dict[str, asyncio.Future] = {}  # link id -> this server's end (a P2PLink once its peer has joined)
    mail: list[MailSender] = []  # (made on the first request that names a mailbox)

    def sender() -> MailSender:
        if not mail:
            mail.append(MailSender())
            weakref.finalize(app, mail[0].close)  # (its connections)
            engine.core.on_pinned, engine.core.on_ready = mail[0].pinned, mail[0].ready
        return mail[0]

    @app.post("/pd/prefill")
    async def prefill(request: Request):
        body = await PrefillBody.from_request(request)
        if body.transfer not in kinds:
            raise ValueError(f"transfer: this prefill server offers {kinds} (its KV is on a {device.type} device)")
        generated = len(body.input_ids) - (body.prompt_len or len(body.input_ids))  # (before a hand-back)
        sampling = dataclasses.replace(SamplingParams.from_dict(body.sampling_params), max_new_tokens=generated + 1)
        if sampling.seed is None:
            raise ValueError("sampling_params.seed: required (the decode server samples on with it)")
        rid = f"{body.rid}/prefill-{uuid.uuid4().hex[:8]}"
        engine.validate(body.input_ids, sampling, rid)
        if body.transfer == "reference" and (mailbox := request.headers.get(MAILBOX_HEADER)):
            # (the pages mailed as they are pinned, then said ready)
            sender().expect(rid, request.headers.get(MAIL_KEY_HEADER) or body.rid, mailbox,
                            request.headers.get(DOORBELL_HEADER))
        try:
            out = await until_disconnected(request, engine.generate(body.input_ids, sampling, rid, body.kv_from,
                                                                    body.prompt_len,
                                                                    export_pinned=body.transfer == "reference"))
        finally:
            if mail:
                mail[0].forget(rid)
        if out is None:
            return Response(status_code=499)
        output_at = time.monotonic()  # (the handler has the output: the engine's part of the export is over)
        sampled = out.output_logprobs  # (only the token it sampled: the earlier ones are the decode server's)
        first = [out.output_ids[-1], sampled[-1], out.weight_versions[-1]] if sampled else None
        meta = {"first": first, "finish_reason": out.finish_reason.to_dict(), "cached_tokens": out.cached_tokens,
                "prefill_tokens": out.prefill_tokens}
        began = time.perf_counter()
        if isinstance(out.kv, PinnedKV):
            if not out.kv.is_recorded():  # (records the pinning queued: the decode server reads them once named)
                await asyncio.to_thread(out.kv.wait_recorded)
            data = _reference_answer(exports.hold(out.kv), out.kv)
            meta["export_s"] = out.kv.read_s + time.perf_counter() - began
            # (on the host's one monotonic clock, for the decode server's record of the whole way: the pinning's
            # start, the engine having the KV ready, the handler having the output, the answer handed to the HTTP
            # server)
            meta |= {"pinned_at": out.kv.pinned_at, "pin_s": out.kv.read_s, "ready_at": out.kv.ready_at,
                     "output_at": output_at, "sent_at": time.monotonic()}
            return Response(data, media_type="application/json", headers={HEADER: json.dumps(meta)})
        if out.kv is None or body.transfer == "bytes":
            data, media = (out.kv.to_bytes() if out.kv is not None else b""), "application/octet-stream"
        else:
            if body.transfer == "p2p" and body.link not in links:
                raise ValueError(f"link: {body.link!r} is no link of this prefill server (open one: /pd/p2p/open)")
            export = P2PExport(out.kv)
            data, media = json.dumps({"id": exports.hold(export), "kv": export.handle}), "application/json"
        meta["export_s"] = (out.kv.read_s if out.kv is not None else 0.0) + time.perf_counter() - began
        return Response(data, media_type=media, headers={HEADER: json.dumps(meta)})

    @app.get("/pd/pool")
    async def pool():
        """This server's KV pool, for a decode server of this host to map once (`kv_mapped.pool_handle`)."""
        if "reference" not in kinds:
            raise ValueError(f"transfer: this prefill server offers {kinds}, not by reference")
        return pool_handle(engine.pool)

    @app.post("/pd/release")
    async def release(request: Request):
        body = await ReleaseBody.from_request(request)
        return {"released": exports.release(body.id)}

    @app.post("/pd/p2p/open")
    async def open_link():
        """Host a link's rendezvous and build this end (rank 0) while the decode server builds its own."""
        store, link_id = await asyncio.to_thread(host_store, P2P_TIMEOUT_S), uuid.uuid4().hex
        link = links[link_id] = asyncio.ensure_future(asyncio.to_thread(P2PLink, store, 0, device, P2P_TIMEOUT_S))
        link.add_done_callback(lambda f: f.cancelled() or f.exception() is None or links.pop(link_id, None))
        return {"id": link_id, "port": store.port, "backend": backend_for(device)}

    @app.post("/pd/p2p/send")
    async def send(request: Request):
        """Send an export over its link (the decode server receives meanwhile); freed once sent, or failed."""
        body = await P2PSendBody.from_request(request)
        if body.link not in links:
            raise ValueError(f"link: {body.link!r} is no link of this prefill server (broken, or never opened)")
        if (held := exports.take(body.id, P2PExport)) is None:
            raise ValueError(f"id: no KV export {body.id!r} to send is held (freed after its timeout, or sent)")
        try:
            async with asyncio.timeout(P2P_TIMEOUT_S):  # (not `wait_for`: on 3.11 it may swallow a cancel)
                link = await asyncio.shield(links[body.link])
            await asyncio.to_thread(link.send, held.tensor)
        except Exception as e:
            if (broken := links.pop(body.link, None)) is not None and broken.done() and not broken.exception():
                broken.result().close()
            raise ValueError(f"link {body.link}: {type(e).__name__}: {e}") from e
        finally:
            held.free(taken=True)
        return {"sent": True}


def _reference_answer(export_id: str, kv: PinnedKV) -> str:
    """A reference's answer body (JSON): the export's id and its handle."""
    return json.dumps({"id": export_id, "kv": kv.handle})


class Exports:
    """A prefill server's KV held for decode servers to take by reference (`PinnedKV`: its pages pinned) or point to
    point (`P2PExport`), by export id: each until its decode server releases it or `RELEASE_TIMEOUT_S` (read as it
    is held) passes, whichever is first; then it is freed. Runs in the server's event loop. What is still held when
    the process exits is freed then."""

    def __init__(self):
        self._held: dict[str, tuple[PinnedKV | P2PExport, asyncio.TimerHandle]] = {}
        weakref.finalize(self, _free_all, self._held)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, shared: PinnedKV | P2PExport) -> str:
        """Hold `shared` (KV shared or to be sent); its export id."""
        export_id = uuid.uuid4().hex
        timer = asyncio.get_running_loop().call_later(RELEASE_TIMEOUT_S, self._expire, export_id)
        self._held[export_id] = (shared, timer)
        return export_id

    def release(self, export_id: str) -> bool:
        """Free the export its decode server is done with; False if none is held by that id (freed already)."""
        if (held := self._held.pop(export_id, None)) is None:
            return False
        shared, timer = held
        timer.cancel()
        shared.free(taken=True)
        return True

    def take(self, export_id: str, kind: type[P2PExport]) -> P2PExport | None:
        """The export of `kind` held by that id, held no more (the caller frees it); None if none is."""
        if not isinstance(self._held.get(export_id, (None,))[0], kind):
            return None
        shared, timer = self._held.pop(export_id)
        timer.cancel()
        return shared

    def _expire(self, export_id: str) -> None:
        if (held := self._held.pop(export_id, None)) is not None:
            log.warning("prefill server: KV export %s was not released within %g s (its decode server died?); "
                        "freed", export_id, RELEASE_TIMEOUT_S)
            held[0].free(taken=False)


def _free_all(held: dict[str, tuple[PinnedKV | P2PExport, asyncio.TimerHandle]]) -> None:
    for shared, _ in held.values():
        with contextlib.suppress(Exception):  # (at exit: what torch tore down already is freed with it)
            shared.free(taken=False)
    held.clear()
