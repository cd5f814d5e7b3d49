"""Distributed runtime: hang forensics now, tensor parallelism next.

- `flight_recorder`: per-rank ring of the last collectives and engine steps, journaled to disk.
- `collectives`: `all_reduce`, `broadcast`, `all_gather`, `barrier` of `torch.distributed`, recorded, with fault hooks.
- `watchdog`: dumps stacks, state and the recorder when the loop stops making progress, on SIGUSR1, on an error exit.
- `analyzer`: `tandem analyze DUMP_DIR`: which rank is missing from which collective, or issued a different one.
- `faults`: fault injection for the tests (skip, delay or exit at a collective; token flips), off by default.

Nothing is imported here, so `faults` stays importable without torch.
"""
