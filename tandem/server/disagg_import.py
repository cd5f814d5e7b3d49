"""A decode server's end of a KV transfer once the prefill server has answered (`tandem.server.disagg` states the
protocol): the KV taken by reference (`_take`: the pages named in the mapped pool), received point to point
(`_receive`) or verified as bytes (`_verify`); by reference written and checked as the answer or its mail lands
(`_write_landed`, `_mailed`), and the export released once the engine is done with it (`_release_settled`);
each transfer's times kept for `GET /pd/transfers` (`_record`, `records`). A part of `disagg.PrefillClient`, split
out by concept (`KVImports`: its methods use the client's engine, pairings and HTTP session)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections import deque

import aiohttp
import torch

from tandem.engine.doorbell import Bell
from tandem.engine.engine import Engine
from tandem.engine.kv_mapped import MappedKV
from tandem.engine.kv_shared import transfer_stream
from tandem.engine.kv_transfer import KVPages, TransferClock
from tandem.server.disagg_mailbox import mapped_from_mail

log = logging.getLogger("tandem.server.disagg")

RELEASE_POST_TIMEOUT_S = 10.0  # a decode server's wait for its release to be heard (the timeout frees it anyway)
RECORDS_KEPT = 64  # a decode server's latest transfers that `/pd/transfers` shows
_RECORDS: weakref.WeakKeyDictionary[Engine, deque] = weakref.WeakKeyDictionary()  # a decode engine's transfers


def records(engine: Engine) -> list[dict]:
    """A decode engine's latest transfers, oldest first (`KVImports._record`)."""
    return list(_RECORDS.get(engine, ()))


def _verify(kv: KVPages) -> None:
    """`kv.verify()` on the transfer stream (`transfer_stream`): its KV is complete, the host having waited for it,
    so its checksums need not wait behind the engine's steps."""
    with transfer_stream(kv.k.device):
        kv.verify()


class Mail:
    """A request's mail as it comes (`disagg_mailbox`): `pages` and `ready`, the futures of its two frames
    (`Mailbox.expect`); `prepared`, the KV the pages mail names (parsed as it landed, while the prefill server
    computes: `KVImports._mailed`), and `kv` once it was written and checked as the ready mail landed
    (`KVImports._mail_ready`, in the turn of the event loop that read the frame's last byte). `bell`: the doorbell
    the prefill server was asked to ring (`doorbell`), if any; `armed` once the engine holds it, its pass queued
    behind it (`Engine.arm_reserved`)."""

    def __init__(self, bell: Bell | None = None):
        self.pages: asyncio.Future | None = None
        self.ready: asyncio.Future | None = None
        self.prepared: MappedKV | None = None
        self.kv: MappedKV | None = None
        self.bell, self.armed = bell, False

    def done(self) -> None:
        """The request's way is over: no mail is wanted now, and a bell the engine did not take goes back."""
        for frame in (self.pages, self.ready):
            if frame is not None:
                frame.cancel()
        if self.bell is not None and not self.armed:
            self.bell.give_back()
        self.bell = None


def _path_s(clock: TransferClock, meta: dict, mail: dict | None) -> float | None:
    """A reference's whole way on the host's one monotonic clock: from the prefill engine having its KV ready (the
    step's result in hand) to the checksums compared here; None where not compared or not marked."""
    ready_at = (mail or meta).get("ready_at")
    return clock.mono["checked"] - float(ready_at) if ready_at is not None and "checked" in clock.mono else None


def _path_parts(clock: TransferClock, meta: dict, mail: dict | None = None) -> dict | None:
    """`_record`'s `path_parts` of a reference's whole way from the prefill engine having the KV ready (None if the
    prefill server did not mark it); with `mail` (the heads of the mail that carried it), the mail's way instead of
    the answer's."""
    try:
        if mail is not None:
            ready_at, sent_at = float(mail["ready_at"]), float(mail["ready_sent_at"])
            return {"pin_s": float(mail["pin_s"]), "to_mail_s": sent_at - ready_at,
                    "mail_s": clock.mono["import"] - sent_at, "import_s": clock.mono["checked"] - clock.mono["import"]}
        ready_at, pin_s, output_at, sent_at = (float(meta[k]) for k in ("ready_at", "pin_s", "output_at", "sent_at"))
    except (KeyError, TypeError, ValueError):
        return None
    return {"pin_s": pin_s, "to_server_s": output_at - ready_at, "answer_s": sent_at - output_at,
            "wire_s": clock.mono["import"] - sent_at, "import_s": clock.mono["checked"] - clock.mono["import"]}


class KVImports:
    """`PrefillClient`'s part after the answer (it sets `engine`, `pools`, `links`, `_http`, `_unpair`)."""

    def _mailed(self, url: str, rid: str, mail: Mail, head: dict, payload: bytes) -> None:
        """`rid`'s pages mail (`disagg_mailbox`: `head`, `payload`) lands, sent as the prefill engine launched the
        step that computes the KV: the pages it names parsed (`mail.prepared`) and, with a doorbell, their pass
        queued behind it (`Engine.arm_reserved`: the device runs it as the prefill engine rings); nothing is read
        before its ready mail (`_mail_ready`) or its ring. A mail that does not parse is logged: the answer's way is
        taken."""
        try:
            if (source := self.pools.get(url)) is not None:
                kv = mapped_from_mail(source, head, payload, url)
                kv.mail, mail.prepared = dict(head), kv
                if mail.bell is not None:
                    mail.armed = self.engine.arm_reserved(rid, kv, int(head["version"]), mail.bell)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("decode server: the mail of %s from %s: %s; it takes the answer's way", rid, url, e)

    def _mail_ready(self, url: str, rid: str, mail: Mail, head: dict, payload: bytes) -> None:
        """`rid`'s ready mail lands (its KV complete in the prefill server's pool): the pages its pages mail named
        written into those its probe set aside (`Engine.write_reserved`; then `mail.kv`) and checked
        (`MappedKV.check`; a difference is kept as the import's failure, which ends the request). Nothing where it
        cannot be written so (no pages mail, nothing set aside, a pause, other weights): the answer's way is
        taken."""
        if (kv := mail.prepared) is None:
            return
        try:
            clock = kv.clock if mail.armed else TransferClock(self.engine.pool.k_cache.device)
            clock.mark("import", device=False)
            kv.mail |= {"ready_at": head["ready_at"], "ready_sent_at": head["sent_at"], "armed": mail.armed,
                        "rung": bool(head.get("rung"))}
            kv.with_clock(clock)
            clock.mark("taken", device=False)
            clock.mark("verified", device=False)
            if not self.engine.write_reserved(rid, kv, int(kv.mail["version"])):
                return
            mail.kv = kv
            if not kv.checked:
                kv.check()
        except (ValueError, KeyError, TypeError) as e:
            log.warning("decode server: the mail of %s from %s: %s; it takes the answer's way", rid, url, e)

    async def _confirm(self, url: str, data: bytes, kv: MappedKV, meta: dict) -> None:
        """The answer (`data`) to a request whose KV came by mail (`kv`, written): it must name the same export
        (pool, positions, pages and their epochs) under the same weight version; `kv` takes its export id. Else the
        export is released and ValueError raised (the request ends; the pages written go back with it)."""
        try:
            answer = json.loads(data)
            export_id, handle = answer["id"], answer["kv"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"kv transfer: the answer is not a KV handle ({type(e).__name__}: {e})") from None
        try:
            same = (handle["pool"] == kv.source.id and (int(handle["start"]), int(handle["end"])) == (kv.start, kv.end)
                    and bytes.fromhex(str(handle["pages"])) == kv.pages.tobytes()
                    and bytes.fromhex(str(handle["epochs"])) == kv.epochs.tobytes()
                    and int(kv.mail["version"]) == int(meta["first"][2]))
        except (KeyError, TypeError, ValueError, IndexError):
            same = False
        if not same:
            await asyncio.shield(self._release(url, export_id))
            raise ValueError("kv transfer: the answer names other KV than its mail did")
        kv.export_id = export_id

    async def _write_landed(self, url: str, rid: str, kv: MappedKV, version: int) -> None:
        """Write `kv` (of weight `version`) into the pages `rid`'s probe set aside, here, as the answer lands
        (`Engine.write_reserved`: no turn of the engine's thread on the way; it blocks this loop for the pass),
        and check it (`MappedKV.check`). Where it cannot write (nothing set aside, a pause, other weights) the
        engine writes and checks it as it places the import. The export is released if this fails."""
        try:
            landed = kv.mail is not None or self.engine.write_reserved(rid, kv, version)  # (by mail: written)
            if landed and not kv.checked:
                kv.check()
        except BaseException:
            await asyncio.shield(self._release(url, kv.export_id))
            raise

    def _record(self, rid: str, kv: KVPages, meta: dict) -> None:
        """Keep the times of `rid`'s transfer (`kv`, written by now unless its engine recomputed the prompt): `export_s`
        the prefill server's (pages read out and checksummed, or pinned; shared or serialised), `take_s` this server's
        from the answer to the KV verified on its device (`copy_s` until copied or received, `verify_s` the checksums),
        `write_s` its write into the pool (device time; `pass_s` from the kernels' launch), `import_s` from the answer
        to the pages written (device-synchronised; by reference checked: with the engine's turn unless written as the
        answer landed, `landed`, then `handoff_s` after it until the engine queued the request); null where not written.
        By reference `path_s`: from the prefill engine having the KV ready (the result of the step that computed it
        in hand) to the checksums compared here, on the host's one monotonic clock, and its parts on that clock
        (`path_parts`): `pin_s` the prefill engine pinning the pages (before the KV was ready: not of `path_s`),
        `to_server_s` from the KV ready to its server's handler having the output (the engine finishing the request,
        the hop between the threads), `answer_s` the answer built, `wire_s` its way to this server's handler,
        `import_s` here (by mail, `mailed`: `pin_s`, `to_mail_s` from the KV ready to the ready mail sent, `mail_s`
        its way here, `import_s`; `armed` where its pass was queued behind a doorbell as the pages mail landed,
        `rung` where the prefill server rang it); not armed, `launch_host_s` the host's time from the pass's first
        mark to its kernels' launch, `pass_wait_s` from that launch to the sums in hand (host), `launch_parts` the
        first by part (`write` to the page index staged, the launch), `wait_parts` the second (the kernels queued,
        the host's wait for the sums returned, the sums and epochs read, compared; armed: from the ready mail)."""
        clock, written = kv.clock, "written" in kv.clock.host
        take_s = clock.host["verified"] - clock.host["import"]
        mapped = isinstance(kv, MappedKV)  # (taken as written: the engine's one pass, checked on the host)
        armed = mapped and bool((kv.mail or {}).get("armed"))  # (its pass queued before "import": no host parts)
        try:
            write_s = clock.seconds("write", "written") if written else None
            pass_s = clock.seconds("launch", "written") if written and "launch" in clock.host else None
            if mapped:
                import_s = clock.host["checked"] - clock.host["import"] if "checked" in clock.host else None
            else:
                import_s = take_s + clock.seconds("verified", "written") if written else None
        except RuntimeError as e:  # (a measurement must not fail the request it measured)
            log.warning("decode server: transfer of %s not timed: %s", rid, e)
            write_s = import_s = pass_s = None
        _RECORDS.setdefault(self.engine, deque(maxlen=RECORDS_KEPT)).append({
            "rid": rid, "transfer": meta["transfer"], "start": kv.start, "end": kv.end,
            "pages": len(kv.pages) if mapped else len(kv.checksums),
            "kv_bytes": kv.kv_bytes if mapped else 2 * kv.k.numel() * kv.k.element_size(),
            "export_s": meta.get("export_s"), "take_s": take_s,
            "copy_s": clock.host["taken"] - clock.host["import"],
            "verify_s": clock.host["verified"] - clock.host["taken"],
            "queue_s": clock.host["write"] - clock.host["import"] if mapped and written and not armed else None,
            "check_s": clock.host["checked"] - clock.host["written"] if mapped and "checked" in clock.host else None,
            "write_s": write_s, "pass_s": pass_s, "import_s": import_s,
            "landed": mapped and "placed" in clock.host,
            "handoff_s": clock.host["placed"] - clock.host["checked"] if mapped and "placed" in clock.host else None,
            "path_s": _path_s(clock, meta, kv.mail) if mapped else None,
            "path_parts": _path_parts(clock, meta, kv.mail) if mapped and "checked" in clock.mono
            else None, "mailed": mapped and kv.mail is not None, "armed": armed,
            "rung": armed and bool(kv.mail.get("rung")),
            "launch_host_s": clock.host["launch"] - clock.host["write"] if mapped and not armed
            and "launch" in clock.host and "write" in clock.host else None,
            "pass_wait_s": clock.host["passed"] - clock.host["launch"] if mapped and not armed
            and "launch" in clock.host and "passed" in clock.host else None,
            "launch_parts": clock.parts(("write", "staged", "launch")) if mapped and not armed else None,
            "wait_parts": clock.parts(("import", "synced", "passed", "checked") if armed
                                      else ("launch", "launched", "synced", "passed", "checked")) if mapped
            else None})

    async def _take(self, url: str, data: bytes, clock: TransferClock, meta: dict) -> MappedKV:
        """The KV a prefill server holds for this one (`data`: its answer naming pages of its pool), as pages of the
        pool mapped at pairing: nothing is read until the engine writes it (`MappedKV.write_into`, which checks its
        checksums). The export is released once the engine is done with it (`_release_settled`); an answer that
        does not parse is released at once, and breaks the pairing if it names another pool."""
        try:
            answer = json.loads(data)
            export_id, handle = answer["id"], answer["kv"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"kv transfer: the answer is not a KV handle ({type(e).__name__}: {e})") from None
        if (source := self.pools.get(url)) is None:
            await asyncio.shield(self._release(url, export_id))
            raise RuntimeError("its pool's mapping was dropped while this request waited (another transfer failed)")
        try:
            kv = MappedKV(source, handle, url, export_id)
        except ValueError:
            self._unpair(url)  # (it may have restarted: map its pool anew)
            await asyncio.shield(self._release(url, export_id))
            raise
        clock.mark("taken", device=False)
        clock.mark("verified", device=False)  # (checked as the engine writes it)
        return kv

    async def _release_settled(self, url: str, kv: MappedKV, generating: asyncio.Future) -> None:
        """Release `kv`'s export once the engine wrote or dropped it, or the request ended (whichever is first)."""
        await asyncio.wait([asyncio.wrap_future(kv.settled), generating], return_when=asyncio.FIRST_COMPLETED)
        await self._release(url, kv.export_id)

    async def _receive(self, url: str, data: bytes, clock: TransferClock) -> KVPages:
        """The KV a prefill server holds for this one (`data`: its answer) received over the link, on this engine's
        device, verified. The link's turn is held from the start of the receive to its end, so the prefill
        server's sends on it come in this order; a failed or timed-out receive breaks the link."""
        try:
            answer = json.loads(data)
            export_id, header = answer["id"], answer["kv"]
            shape, dtype = [int(n) for n in header["shape"]], getattr(torch, str(header["dtype"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"kv transfer: the answer is not a KV header ({type(e).__name__}: {e})") from None
        if (entry := self.links.get(url)) is None:
            raise RuntimeError("its link broke while this request waited (another transfer failed)")
        link_id, link, turn = entry
        kv_2LTKD = torch.empty((2, *shape), dtype=dtype, device=self.engine.pool.k_cache.device)
        if kv_2LTKD.numel() == 0:  # (nothing to send: only let it go)
            await asyncio.shield(self._release(url, export_id))
        else:
            async with turn:
                received = asyncio.ensure_future(asyncio.to_thread(link.recv, kv_2LTKD))
                try:
                    async with self._http().post(f"{url}/pd/p2p/send", json={"id": export_id, "link": link_id}) as r:
                        if r.status != 200:
                            raise RuntimeError(f"/pd/p2p/send answered {r.status}: "
                                               f"{(await r.read())[:300].decode(errors='replace')}")
                except BaseException:
                    self._unpair(url)  # (which ends the receive, or its timeout does)
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(received)
                    raise
                try:
                    await asyncio.shield(received)  # (a receive cannot be cancelled halfway: it ends or times out)
                except BaseException:  # (cancelled too: the turn must not pass while the receive runs on)
                    self._unpair(url)
                    raise
        kv = KVPages.from_header(header, kv_2LTKD[0], kv_2LTKD[1])
        clock.mark("taken")
        await asyncio.to_thread(_verify, kv)
        clock.mark("verified")
        return kv

    async def _release(self, url: str, export_id: str) -> None:
        try:
            async with self._http().post(f"{url}/pd/release", json={"id": export_id},
                                         timeout=aiohttp.ClientTimeout(total=RELEASE_POST_TIMEOUT_S)) as r:
                if r.status != 200:
                    log.warning("decode server: %s/pd/release of KV export %s answered %d: %s", url, export_id,
                                r.status, (await r.read())[:300].decode(errors="replace"))
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("decode server: could not release KV export %s at %s (it frees it after its timeout): %s: "
                        "%s", export_id, url, type(e).__name__, e)
