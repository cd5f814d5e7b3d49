"""A decode step's small inputs in one buffer: filled on the host in one pinned buffer, sent in one copy.

A decode step needs a dozen short vectors on the device: the input ids, positions, new slots and lengths the graph
reads, the sampling parameters the sampler reads, and the rows whose input token the step in flight samples (with
where in its samples). Sent one by one, each costs the host a tensor, a pinned copy of it and a copy's launch; at a
few rows a step that is most of the step's host time. `DecodeInputs` lays the vectors of a batch size out in one
byte buffer, a block per dtype, keeps one such buffer on the device for every batch size of the decode graphs
(which read their inputs there), and fills a fresh pinned one on the host each step with three assignments: one
copy then moves them all. The block table, whose width follows the step's longest context, travels in the same
pinned buffer but is copied on its own into the table every size shares.

A fresh pinned buffer (PyTorch's caching host allocator) is not reused before the copy out of it completes, so the
host may fill the next step's while this one's copy is still queued.
"""

from __future__ import annotations

import array

import numpy as np
import torch

from tandem.engine.kv_pool import KVPool
from tandem.engine.sampler import SamplingBatch
from tandem.engine.scheduler import PENDING, Chunk

# The vectors of a decode step, [rows] each, grouped by dtype: each group is one [len(group), rows] block, the
# blocks one after another (int64, float32, int32), so the host fills each with one assignment
INT64 = ("ids", "positions", "slots",  # what the graph reads, with seq_lens
         "top_ks", "seeds", "generated",  # what the sampler reads, with the floats
         "pending_rows", "pending_src")  # row <- index in the step in flight's samples (the first few)
FLOAT32 = ("temperatures", "top_ps", "min_ps")
INT32 = ("seq_lens",)
GROUPS = ((INT64, torch.int64, np.int64), (FLOAT32, torch.float32, np.float32), (INT32, torch.int32, np.int32))
ROW_BYTES = sum(len(names) * dtype.itemsize for names, dtype, _ in GROUPS)  # (a multiple of 4; int64 first)


def _blocks(buf, rows: int, view) -> list:
    """Each group's block [len(group), rows] of `buf` (uint8, at least ROW_BYTES * rows), through `view(part,
    dtype)`."""
    out, offset = [], 0
    for names, torch_dtype, numpy_dtype in GROUPS:
        size = len(names) * rows * torch_dtype.itemsize
        out.append(view(buf[offset:offset + size], torch_dtype, numpy_dtype).reshape(len(names), rows))
        offset += size
    return out


def block_table_into(out: np.ndarray, reqs, width: int) -> None:
    """Fill `out` (int32 [rows, width]): row i with the first `width` pages of `reqs[i]`, then zeros (rows past
    the end all zeros). Built from each request's page array, so no Python int is converted per step."""
    rows = out.shape[0]
    flat = array.array("i", bytes(4 * rows * width))
    for i, req in enumerate(reqs):
        pages = req.page_array()
        n = min(width, len(pages))
        flat[i * width:i * width + n] = pages[:n]
    out.reshape(-1)[:] = np.frombuffer(flat, dtype=np.int32)


def block_table(reqs, width: int, rows: int | None = None) -> torch.Tensor:
    """int32 [rows (default: one a request), width], as `block_table_into` fills it."""
    out = torch.empty(len(reqs) if rows is None else rows, width, dtype=torch.int32)
    block_table_into(out.numpy(), reqs, width)
    return out


class DecodeInputs:
    """The device inputs of every decode batch size (`views(bs)`: each vector of INT64, FLOAT32 and INT32, [bs]),
    in one device buffer, and `send`, which fills and copies a step's."""

    def __init__(self, batch_sizes: list[int], device: torch.device):
        self.device = device
        self.buffer = torch.zeros(ROW_BYTES * sum(batch_sizes), dtype=torch.uint8, device=device)  # (the race
        self.regions, self._views, start = {}, {}, 0  # guard watches it whole)
        for bs in batch_sizes:
            self.regions[bs] = self.buffer[start:start + ROW_BYTES * bs]
            blocks = _blocks(self.regions[bs], bs, lambda part, dtype, _: part.view(dtype))
            self._views[bs] = {name: block[i] for (names, _, _), block in zip(GROUPS, blocks, strict=True)
                               for i, name in enumerate(names)}
            start += ROW_BYTES * bs
        self._sliced: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (bs, n, *names) -> views [:n], made once

    def views(self, bs: int) -> dict[str, torch.Tensor]:
        return self._views[bs]

    def _first(self, bs: int, n: int, *names: str) -> tuple[torch.Tensor, ...]:
        """views(bs)[name][:n] of each name, made on first use (a slice is host work every step would repeat)."""
        key = (bs, n, *names)
        if key not in self._sliced:
            self._sliced[key] = tuple(self._views[bs][name][:n] for name in names)
        return self._sliced[key]

    def send(self, chunks: list[Chunk], bs: int, pool: KVPool, table_out: torch.Tensor,
             vocab_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, SamplingBatch]:
        """Fill a pinned buffer with the step's inputs (padding rows: id 0, position 0, `pool`'s scratch slot,
        length 0) and its block table (`table_out`'s shape: [bs, width], a view of the shared table), and copy
        them to the device on the current stream. Every chunk is one token that samples. Returns the rows whose
        token the step in flight samples and those tokens' indices there (device views; None if no row's is), and
        the sampling parameters (device views; `with_requests` not applied). Raises what numpy raises for a
        value its dtype cannot hold (a seed past int64)."""
        n, page_size, width = len(chunks), pool.page_size, table_out.shape[1]
        reqs = [c.req for c in chunks]
        starts = [c.start for c in chunks]
        ids = [r.tokens[s] for r, s in zip(reqs, starts, strict=True)]
        pending = [i for i, t in enumerate(ids) if t == PENDING]
        pad, unused = [0] * (bs - n), [0] * (bs - len(pending))
        if pending:
            ids = [0 if t == PENDING else t for t in ids]
        buf = torch.empty(ROW_BYTES * bs + 4 * bs * width, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        host = buf.numpy()
        i64, f32, i32 = _blocks(host, bs, lambda part, _, dtype: part.view(dtype))
        i64.reshape(-1)[:] = [
            *ids, *pad, *starts, *pad,
            *[r.pages[s // page_size] * page_size + s % page_size for r, s in zip(reqs, starts, strict=True)],
            *[pool.scratch_slot] * (bs - n),
            *[r.sampling.top_k for r in reqs], *pad, *[r.seed for r in reqs], *pad,
            *[r.num_generated for r in reqs], *pad,
            *pending, *unused, *[reqs[i].pending_row for i in pending], *unused]
        f32.reshape(-1)[:] = [*[r.sampling.temperature for r in reqs], *pad, *[r.sampling.top_p for r in reqs], *pad,
                              *[r.sampling.min_p for r in reqs], *pad]
        i32.reshape(-1)[:] = [*[s + 1 for s in starts], *pad]
        block_table_into(host[ROW_BYTES * bs:].view(np.int32).reshape(bs, width), reqs, width)
        self.regions[bs].copy_(buf[:ROW_BYTES * bs], non_blocking=True)
        table_out.copy_(buf[ROW_BYTES * bs:].view(torch.int32).view(bs, width), non_blocking=True)
        temperatures, top_ps, top_ks, min_ps, seeds, generated = self._first(
            bs, n, "temperatures", "top_ps", "top_ks", "min_ps", "seeds", "generated")
        return self._first(bs, len(pending), "pending_rows", "pending_src") if pending else None, SamplingBatch(
            temperatures=temperatures, top_ps=top_ps, top_ks=top_ks, min_ps=min_ps, seeds=seeds, positions=generated,
            needs_filter=any(0 < r.sampling.top_k < vocab_size or r.sampling.top_p < 1 or r.sampling.min_p > 0
                             for r in reqs))
