"""Shared by the disaggregation tests: the mutants that check the pause gate of KV imports too late or not at
all; a decode server without a mailbox (its KV by reference takes the answer's way)."""

from tandem.engine.core import EngineCore
from tandem.server.disagg_mailbox import Mailbox


def gate_imports_late(monkeypatch) -> None:
    """Make the engine core place KV imports whatever the pause (the gate checked too late: as if not paused yet);
    the falsifier of the tests that nothing is written into the pool while the engine is paused."""
    original = EngineCore._import_request

    def late(self, cmd):
        paused, self.paused = self.paused, None
        try:
            original(self, cmd)
        finally:
            self.paused = paused
    monkeypatch.setattr(EngineCore, "_import_request", late)


def no_mail(monkeypatch) -> None:
    """Decode servers of this process open no mailbox (`disagg_mailbox`): their prefill servers mail nothing, and KV
    by reference comes by the answer alone (what the tests of that way need, wherever the prefill server runs)."""

    async def refused(self):
        raise OSError("no mailbox (a test)")
    monkeypatch.setattr(Mailbox, "start", refused)


def write_reserved_blind_to_pause(monkeypatch) -> None:
    """A mutant `EngineCore.write_reserved` that does not see a pause (the falsifier of the pause gate on writes
    that land outside the engine's thread)."""
    real = EngineCore.write_reserved

    def unpaused(self, rid, kv, version):
        paused, self.paused = self.paused, None
        try:
            return real(self, rid, kv, version)
        finally:
            self.paused = paused
    monkeypatch.setattr(EngineCore, "write_reserved", unpaused)
