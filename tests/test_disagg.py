"""Prefill/decode disaggregation on CPU (fp32): a prefill engine computes prompts and hands their KV to a decode
engine, which then generates exactly what one unified engine does; in process, then over real HTTP servers."""

import asyncio
import dataclasses
import gc
import time

import httpx
import pytest
import torch
from disagg_helpers import gate_imports_late

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.kv_transfer import KVPages, page_checksums, wire_meta
from tandem.server.http import ServerThread
from tandem.types import SamplingParams

POOL = EngineConfig(page_size=4, num_pages=96)
PREFILL, DECODE = dataclasses.replace(POOL, role="prefill"), dataclasses.replace(POOL, role="decode")
SEEDED = SamplingParams(max_new_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)


def prompt(n, seed=0):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def disaggregated(p: Engine, d: Engine, ids, sampling, rid=None):
    """What a decode server does for one prompt, in process: probe, prefill there, import here."""
    sampling = sampling if sampling.seed is not None else dataclasses.replace(sampling, seed=0)
    kv_from = await d.probe(ids, rid)
    first = await p.generate(ids, dataclasses.replace(sampling, max_new_tokens=1), export_kv_from=kv_from)
    out = await d.generate_imported(ids, sampling, (first.output_ids, first.output_logprobs, first.weight_versions),
                                    first.kv, rid)
    return out, first.kv


def same(a, b):
    return (a.output_ids, a.output_logprobs, a.weight_versions) == (b.output_ids, b.output_logprobs, b.weight_versions)


@pytest.mark.parametrize("decode_config", [POOL, dataclasses.replace(POOL, num_pages=24, host_cache="write_through")],
                         ids=["device", "small pool with a host tier"])
def test_prefill_then_decode_generates_what_one_engine_does(decode_config):
    """Greedy and seeded. A first turn: exactly (tokens, logprobs, versions). Later turns of a multi-turn episode
    send only the pages the decode engine lacks, and give the same tokens, their logprobs within rounding: the
    tokens the decode engine generated have their KV there (decode steps), and the prefill engine computes them
    again (one prefill chunk), which rounds differently. The decode engine's pages after an import hold what the
    prefill engine read."""
    async def go():
        with Engine("tiny", POOL) as unified, Engine("tiny", POOL) as p, Engine("tiny", decode_config) as d:
            for sampling in (GREEDY, SEEDED):
                history = prompt(27, seed=1 + sampling.greedy)
                for turn in range(3):
                    want = await unified.generate(history, sampling)
                    got, kv = await disaggregated(p, d, history, sampling)
                    if turn == 0:
                        assert same(got, want), (got, want)
                    assert got.output_ids == want.output_ids and got.weight_versions == want.weight_versions
                    assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)
                    if turn and decode_config.host_cache == "off":  # the history's last turn is cached on d
                        assert kv.start == (len(history) - 8) // 4 * 4, (kv.start, len(history))
                    history = history + got.output_ids + prompt(7, seed=turn + 10)
            # a lone prompt, then the decode engine's pages of it equal the prefill engine's page by page
            ids = prompt(21, seed=3)
            out, kv = await disaggregated(p, d, ids, dataclasses.replace(GREEDY, max_new_tokens=2))
            pages = d.cache.match(ids).pages
            slots = d.pool.slots(pages, 0, 20)
            assert kv.start == 0 and page_checksums(d.pool.k_cache[:, slots], d.pool.v_cache[:, slots], 4) == \
                kv.checksums[:5]
    asyncio.run(go())


def test_a_page_that_arrives_changed_is_named_and_nothing_is_written():
    async def go():
        with Engine("tiny", POOL) as p, Engine("tiny", POOL) as d:
            ids = prompt(18)
            first = await p.generate(ids, dataclasses.replace(GREEDY, max_new_tokens=1), export_kv_from=0)
            k = first.kv.k.clone()
            k[1, 9, 0, 3] += 1.0  # position 9: the third page
            bad = KVPages(0, k, first.kv.v, 4, first.kv.checksums)
            before = d.pool.k_cache.clone()
            with pytest.raises(ValueError, match=r"page 2 \(positions 8"):
                await d.generate_imported(ids, dataclasses.replace(GREEDY, seed=1), ([1], [-1.0], [0]), bad)
            assert torch.equal(d.pool.k_cache, before)
            data = first.kv.to_bytes()
            wire = KVPages.from_bytes(data, wire_meta(data))
            assert torch.equal(wire.k, first.kv.k) and wire.checksums == first.kv.checksums
    asyncio.run(go())


def writes_while_paused(monkeypatch, gate_late: bool) -> bool:
    """Pause the decode engine (in place), import a request, read the pool, continue: whether the pool changed
    before the continue. `gate_late`: a mutant core that places imports whatever the pause."""
    if gate_late:
        gate_imports_late(monkeypatch)

    async def go():
        with Engine("tiny", POOL) as p, Engine("tiny", POOL) as d:
            ids = prompt(22)
            first = await p.generate(ids, dataclasses.replace(SEEDED, max_new_tokens=1), export_kv_from=0)
            await d.pause("in_place")
            before = d.pool.k_cache.clone()
            task = asyncio.ensure_future(d.generate_imported(
                ids, SEEDED, (first.output_ids, first.output_logprobs, [0]), first.kv))
            await asyncio.sleep(0)  # (the task submits its import)
            await d.get_stats()  # (which has been applied: commands run in order)
            written = not torch.equal(d.pool.k_cache, before)
            await d.resume()
            out = await task
            assert len(out.output_ids) == SEEDED.max_new_tokens and not torch.equal(d.pool.k_cache, before)
            return written
    return asyncio.run(go())


def test_an_import_arriving_while_paused_writes_nothing_until_continue(monkeypatch):
    assert not writes_while_paused(monkeypatch, gate_late=False)


def test_the_pause_gate_falsifier_a_late_gate_writes_while_paused(monkeypatch):
    assert writes_while_paused(monkeypatch, gate_late=True)


def test_an_abort_pause_ends_a_request_whose_prefill_is_on_its_way():
    async def go():
        with Engine("tiny", POOL) as p, Engine("tiny", POOL) as d:
            ids = prompt(15)
            kv_from = await d.probe(ids, "r1")  # the decode engine now expects r1
            first = await p.generate(ids, dataclasses.replace(SEEDED, max_new_tokens=1), export_kv_from=kv_from)
            free = (await d.get_stats()).pages_free
            await d.pause("abort")
            out = await d.generate_imported(ids, SEEDED, (first.output_ids, first.output_logprobs, [0]), first.kv,
                                            "r1")
            assert out.finish_reason.type == "abort" and "paused" in out.finish_reason.message
            assert (await d.get_stats()).pages_free == free  # nothing was imported
            await d.resume()
    asyncio.run(go())


def test_prefill_and_decode_servers_over_http():
    """Real servers: a decode server's /generate with bootstrap equals a unified engine's answer, pairing refuses a
    prefill server of another page size by name, and a prefill server that is gone ends the request with an abort
    naming it, the decode server's pages back where they were."""
    with Engine("tiny", POOL) as unified, Engine("tiny", PREFILL) as p, Engine("tiny", DECODE) as d, \
            Engine("tiny", dataclasses.replace(PREFILL, page_size=8)) as other:
        ids, sampling = prompt(30), {"max_new_tokens": 8, "temperature": 0.7, "seed": 11, "ignore_eos": True}
        want = asyncio.run(unified.generate(ids, SamplingParams(**sampling)))
        ps = ServerThread(p).start()
        with ServerThread(d) as ds, ServerThread(other) as bad:
            body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
                    "bootstrap": {"prefill_url": ps.url}}
            r = httpx.post(f"{ds.url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["output_ids"] == want.output_ids
            assert [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]] == want.output_logprobs
            r = httpx.post(f"{ds.url}/generate", json=body | {"bootstrap": {"prefill_url": bad.url}}, timeout=60)
            assert r.status_code == 400 and "page_size is 8, this server's 4" in r.text, r.text
            r = httpx.post(f"{ps.url}/generate", json=body, timeout=60)
            assert r.status_code == 400 and "only a decode server" in r.text
            free = httpx.get(f"{ds.url}/engine_stats").json()["pages_free"]
            ps.stop()  # the prefill server goes away
            r = httpx.post(f"{ds.url}/generate", json=body | {"rid": "gone"}, timeout=60)
            assert r.status_code == 200
            finish = r.json()["meta_info"]["finish_reason"]
            assert finish["type"] == "abort" and ps.url in finish["message"], finish
            assert httpx.get(f"{ds.url}/engine_stats").json()["pages_free"] == free


def test_a_first_token_outside_the_vocabulary_ends_only_its_request(monkeypatch):
    """A prefill server that answers with a token the model has no row for: the decode server ends that request
    with an abort naming the server and the token, its pages back, and decodes the next request as before (the
    token would otherwise reach the decode engine's embedding and fail every request of its step)."""
    with Engine("tiny", PREFILL) as p, Engine("tiny", DECODE) as d:
        generate, vocab = p.generate, p.model_config.vocab_size

        async def past_the_vocabulary(*args, **kwargs):
            out = await generate(*args, **kwargs)
            out.output_ids[-1] = vocab + 3
            return out

        with ServerThread(p) as ps, ServerThread(d) as ds:
            body = {"input_ids": prompt(30), "sampling_params": {"max_new_tokens": 6, "seed": 1, "ignore_eos": True},
                    "bootstrap": {"prefill_url": ps.url}}
            free = httpx.get(f"{ds.url}/engine_stats").json()["pages_free"]
            monkeypatch.setattr(p, "generate", past_the_vocabulary)
            r = httpx.post(f"{ds.url}/generate", json=body, timeout=60)
            finish = r.json()["meta_info"]["finish_reason"]
            assert r.status_code == 200 and finish["type"] == "abort", r.text
            assert ps.url in finish["message"] and f"sent token {vocab + 3}" in finish["message"], finish
            assert httpx.get(f"{ds.url}/engine_stats").json()["pages_free"] == free
            monkeypatch.undo()
            r = httpx.post(f"{ds.url}/generate", json=body, timeout=60)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 6, r.text


def test_kv_of_other_weights_is_not_imported_the_prompt_is_recomputed():
    """A decode engine updated since the prefill engine computed the KV takes only the first token (with its
    version) and computes the prompt itself, under its own weights."""
    async def go():
        with Engine("tiny", POOL) as p, Engine("tiny", POOL) as d:
            ids = prompt(19)
            first = await p.generate(ids, dataclasses.replace(SEEDED, max_new_tokens=1), export_kv_from=0)
            await d.pause("retract")
            await d.update_weights(d.model.named_parameters(), version=3)  # (the same values, a new version)
            await d.resume()
            out = await d.generate_imported(ids, SEEDED, (first.output_ids, first.output_logprobs, [0]), first.kv)
            assert out.weight_versions == [0] + [3] * (SEEDED.max_new_tokens - 1)
            assert (await d.get_stats()).imports_recomputed == 1 and out.prefill_tokens == len(ids) + 1  # (+ token 1)
    asyncio.run(go())


def test_the_random_agent_runs_through_a_prefill_and_a_decode_server(tmp_path):
    """`tandem run placement=disaggregated`: two server processes behind a router, fully async, weights pushed to
    both every step; three steps trained, none dropped."""
    from tandem.run.main import main

    records = main(None, ["steps=3", f"out_dir={tmp_path}", "placement=disaggregated", "rollout.max_staleness=1"])
    assert [r["step"] for r in records] == [1, 2, 3] and all("error" not in r for r in records), records
    assert records[-1]["version"] == 3 and sum(r["dropped_groups"] for r in records) == 0, records[-1]
    assert gc.get_freeze_count() == 0  # (the heap the run froze, let go: nanobind reports what a frozen heap kept)


def test_a_retract_pause_hands_a_decoding_request_back_to_the_prefill_server():
    """Pausing the decode server in mode retract while a request decodes, then updating both servers' weights (same
    values, version 1): the request goes back to the prefill server, which computes its prompt and the tokens so far
    under version 1, and decoding goes on; the client sees one answer, tokens as one engine gives them, each with
    the version that sampled it."""
    import concurrent.futures

    sampling = {"max_new_tokens": 60, "temperature": 0.7, "seed": 3, "ignore_eos": True}
    ids = prompt(20, seed=5)
    with Engine("tiny", POOL) as unified, Engine("tiny", PREFILL) as p, Engine("tiny", DECODE) as d, \
            ServerThread(p) as ps, ServerThread(d) as ds, concurrent.futures.ThreadPoolExecutor(1) as pool:
        want = asyncio.run(unified.generate(ids, SamplingParams(**sampling)))
        body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True,
                "bootstrap": {"prefill_url": ps.url}}
        answer = pool.submit(httpx.post, f"{ds.url}/generate", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while not asyncio.run(d.get_stats()).generated_tokens >= 5:  # decoding on the decode server
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for engine in (d, p):  # as a router does: pause both, update both, continue both
            asyncio.run(engine.pause("retract"))
        for engine in (d, p):
            asyncio.run(engine.update_weights(engine.model.named_parameters(), version=1))
        for engine in (d, p):
            asyncio.run(engine.resume())
        r = answer.result()
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert r.json()["output_ids"] == want.output_ids and meta["finish_reason"]["type"] == "length"
        versions = meta["output_token_weight_versions"]
        k = versions.index(1)  # tokens before the hand-back have version 0, after it 1
        assert 5 <= k < 60 and versions == [0] * k + [1] * (60 - k), versions
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(want.output_logprobs, abs=1e-5)
        # the prefill server computed it again after the hand-back (twice, if it took the handed-back request before
        # its own pause: under version 0, which the decode server hands back once more)
        assert asyncio.run(p.get_stats()).generated_tokens >= 2


def test_through_a_router_an_update_reaches_both_roles_and_a_dead_decode_server_is_named(tmp_path):
    """Paused through the router, a weight update from disk reaches the prefill and the decode server (the same
    version on both, and what they then generate is the new weights' answer); a decode server that goes away is a
    502 naming it, which the engine client raises as unreachable (the rollout manager then re-runs the group), and
    the next try goes to the other decode server."""
    from safetensors.torch import save_file

    from tandem.engine.client import EngineClient, EngineUnreachable
    from tandem.model.loader import build_model
    from tandem.server.guard import ServerOptions
    from tandem.server.router import RouterConfig, build_router_app

    new = {name: p.detach().contiguous() for name, p in build_model("tiny", seed=9).named_parameters()}
    save_file(new, tmp_path / "model.safetensors")
    options = ServerOptions(weight_dirs=(str(tmp_path),))
    ids, greedy = prompt(25, seed=8), SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine("tiny", POOL) as unified, Engine("tiny", PREFILL) as p, Engine("tiny", DECODE) as d0, \
            Engine("tiny", DECODE) as d1, ServerThread(p, options=options) as ps, \
            ServerThread(d1, options=options) as ds1:
        ds0 = ServerThread(d0, options=options).start()
        config = RouterConfig(prefill=(ps.url,), decode=(ds0.url, ds1.url), probe_interval_s=0.2)
        with ServerThread(app=build_router_app(config)) as router, httpx.Client(base_url=router.url,
                                                                                 timeout=60) as client:
            assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
            assert all(e.paused == "retract" for e in (p, d0, d1))
            r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": 4})
            assert r.status_code == 200, r.text
            assert client.post("/continue_generation").status_code == 200
            assert [e.weight_version for e in (p, d0, d1)] == [4, 4, 4]
            asyncio.run(unified.load_paused(new, 4, "retract"))
            want = asyncio.run(unified.generate(ids, greedy)).output_ids
            body = {"input_ids": ids, "sampling_params": dataclasses.asdict(greedy)}
            assert client.post("/generate", json=body).json()["output_ids"] == want

            engine = EngineClient(router.url, timeout_s=30).connect()
            ds0.stop()  # one decode server goes away (the first: where a tie between idle servers goes)
            errors, outs = [], []

            async def episodes():
                for i in range(4):  # new episodes: some are placed on the server that went away
                    try:
                        outs.append(await engine.generate(prompt(21, seed=20 + i), greedy))
                    except EngineUnreachable as e:
                        errors.append(str(e))
                await engine.aclose()
            asyncio.run(episodes())
            # marked down after its first failure: the rest go to the other
            assert len(outs) == 3 and len(errors) == 1 and ds0.url in errors[0] and "502" in errors[0], errors
