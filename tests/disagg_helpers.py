"""Shared by the disaggregation tests: the mutant that checks the pause gate of KV imports too late."""

from tandem.engine.core import EngineCore


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
