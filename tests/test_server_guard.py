"""Nothing is reachable without a key, admin endpoints need the admin key, bodies are bounded in size and time, weights
load from disk only inside the allowed directories and only finite, and versions never go backwards. Each protection
is shown refusing what it must and letting through what it must."""

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tandem.config import EngineConfig, resolve_model
from tandem.engine.client import EngineClient
from tandem.engine.engine import Engine
from tandem.server.guard import ADMIN_PATHS, ServerOptions
from tandem.server.http import ServerThread

KEY, ADMIN_KEY = "client-key-123", "admin-key-4567"
GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", EngineConfig(page_size=16)) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    options = ServerOptions(api_key=KEY, admin_api_key=ADMIN_KEY, max_body_bytes=4096, body_timeout_s=0.5,
                            header_timeout_s=0.5, weight_dirs=(str(root / "allowed"),))
    with ServerThread(engine, options=options) as s:
        s.root = root
        yield s


def call(server, path, key=None, body=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    method = "GET" if path in ("/health", "/get_model_info", "/metrics", "/engine_stats") else "POST"
    return httpx.request(method, server.url + path, json=body if method == "POST" else None, headers=headers,
                         timeout=30)


@pytest.mark.parametrize("path", ["/generate", "/get_model_info", "/metrics", "/engine_stats", "/abort_request",
                                  *sorted(ADMIN_PATHS)])
def test_every_endpoint_but_health_needs_a_key(server, path):
    for key in (None, "wrong-key-000"):
        r = call(server, path, key, {})
        assert r.status_code == 401, (path, key, r.text)
        assert "missing or wrong API key" in r.json()["error"]["message"]
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert call(server, "/health").status_code == 200


@pytest.mark.parametrize("path", sorted(ADMIN_PATHS))
def test_admin_endpoints_refuse_the_client_key_and_take_the_admin_key(server, path):
    r = call(server, path, KEY, {})
    assert r.status_code == 403 and "admin API key" in r.json()["error"]["message"], r.text
    r = call(server, path, ADMIN_KEY, {})
    assert r.status_code not in (401, 403), r.text  # past the guard (the route may refuse the empty body)
    call(server, "/continue_generation", ADMIN_KEY)


def test_clients_generate_and_abort_their_own_requests_but_not_everyone_s(server):
    r = call(server, "/generate", KEY, {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert call(server, "/abort_request", KEY, {"rid": "someone"}).status_code == 200
    r = call(server, "/abort_request", KEY, {"abort_all": True})
    assert r.status_code == 403 and "abort_all" in r.json()["error"]["message"]
    assert call(server, "/abort_request", ADMIN_KEY, {"abort_all": True}).status_code == 200
    assert call(server, "/generate", ADMIN_KEY, {"input_ids": [1, 2], "sampling_params": GREEDY}).status_code == 200


def test_a_body_over_the_limit_is_refused_by_its_length_or_as_it_arrives(server):
    big = {"input_ids": list(range(1, 2000)), "sampling_params": GREEDY}
    r = call(server, "/generate", KEY, big)
    assert r.status_code == 413 and "over the limit of 4096" in r.json()["error"]["message"]

    def chunks():  # no content-length: counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(server.url + "/generate", content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413, r.text
    assert call(server, "/generate", KEY, {"input_ids": [1, 2, 3], "sampling_params": GREEDY}).status_code == 200


def test_a_body_that_trickles_is_cut_off(server):
    """Headers, then part of the body, then silence: a 408 after body_timeout_s, not a connection held forever."""
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(head + b'{"input_ids": [1,')
        t0 = time.monotonic()
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert 0.4 < time.monotonic() - t0 < 5


@pytest.mark.parametrize("after_a_request", [False, True])
def test_a_request_whose_headers_trickle_is_cut_off(server, after_a_request):
    """Part of a request line and headers, then silence (on a new connection, or on one kept alive after a
    request): the server closes the connection after header_timeout_s instead of holding it forever."""
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        if after_a_request:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert s.recv(4096) == b""  # closed
    assert 0.3 < time.monotonic() - t0 < 5


def _checkpoint(directory, named):
    directory.mkdir(parents=True, exist_ok=True)
    save_file(named, directory / "model.safetensors")
    return str(directory)


def test_weights_load_only_from_allowed_directories_and_only_finite(server, engine):
    params = {n: p.detach().clone().contiguous() for n, p in engine.model.named_parameters()}
    allowed = server.root / "allowed"
    good = _checkpoint(allowed / "good", params)
    outside = _checkpoint(server.root / "elsewhere", params)
    (allowed / "escape").mkdir(parents=True)
    (allowed / "escape" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": f"{outside}/model.safetensors"}}))
    (allowed / "link").symlink_to(outside)
    nan = dict(params, **{"model.norm.weight": torch.full_like(params["model.norm.weight"], float("nan"))})
    poisoned = _checkpoint(allowed / "nan", nan)
    call(server, "/pause_generation", ADMIN_KEY, {"mode": "abort"})
    try:
        version = call(server, "/get_model_info", KEY).json()["weight_version"]
        refusals = {outside: "outside the directories", str(allowed / "link"): "outside the directories",
                    str(allowed / "escape"): "not a file of", str(allowed / "good" / ".." / ".." / "elsewhere"):
                    "outside the directories", poisoned: "NaN or infinite"}
        for path, message in refusals.items():
            r = call(server, "/update_weights_from_disk", ADMIN_KEY, {"model_path": path})
            assert r.status_code == 400 and message in r.json()["message"], (path, r.text)
        assert call(server, "/get_model_info", KEY).json()["weight_version"] == version  # nothing loaded
        r = call(server, "/update_weights_from_disk", ADMIN_KEY, {"model_path": good, "weight_version": version + 5})
        assert r.status_code == 200 and r.json()["weight_version"] == version + 5, r.text
        r = call(server, "/update_weights_from_disk", ADMIN_KEY, {"model_path": good, "weight_version": version + 4})
        assert r.status_code == 400 and "older than the engine's version" in r.json()["message"]
        r = call(server, "/update_weights_from_disk", ADMIN_KEY, {"model_path": good, "weight_version": 2**60})
        assert r.status_code == 400 and "weight_version" in r.json()["message"]
    finally:
        call(server, "/continue_generation", ADMIN_KEY)


def test_a_weight_group_join_asks_for_a_bounded_timeout(server):
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo",
            "timeout_s": 1e300}
    r = call(server, "/init_weights_update_group", ADMIN_KEY, body)
    assert r.status_code == 400 and "timeout_s: at most 600" in r.json()["message"], r.text


def test_the_client_sends_its_key(server):
    async def go(client):
        out = await client.generate([1, 2, 3])
        await client.aclose()
        return out

    client = EngineClient(server.url, timeout_s=30, api_key=KEY).connect()
    assert len(asyncio.run(go(client)).output_ids) > 0
    with pytest.raises(Exception, match="401"):
        EngineClient(server.url, timeout_s=30).connect()


def test_a_directory_with_only_pickled_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                                      "num_key_value_heads": 1, "head_dim": 16}))
    assert resolve_model(str(tmp_path))[1] is None  # no weights at all: random ones, as for a preset
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin but no \\*.safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("host, key, allow, refused", [
    ("0.0.0.0", None, False, True), ("0.0.0.0", KEY, False, False), ("0.0.0.0", None, True, False),
    ("127.0.0.1", None, False, False), ("::1", None, False, False)])
def test_serving_beyond_loopback_needs_a_key_or_an_explicit_choice(monkeypatch, host, key, allow, refused):
    from tandem.cli import _server_options

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    args = type("Args", (), dict(host=host, api_key=key, admin_api_key=None, allow_unauthenticated=allow,
                                 weight_dir=None, model="tiny", max_body_bytes=1 << 20))
    if refused:
        with pytest.raises(ValueError, match="binding beyond loopback"):
            _server_options(args)
    else:
        assert _server_options(args).api_key == key


def test_a_cancel_that_comes_as_a_body_piece_arrives_still_cancels_the_read():
    """A request's task cancelled (its client gone, the server stopping) in the turn of the loop a piece of its body
    arrives in: the bounded read must end cancelled, not hand the piece on (as `asyncio.wait_for` does on Python
    3.11 when both come in one turn). Every turn from the piece's arrival on."""
    from cancel_helpers import cancel_outcomes

    from tandem.server.guard import Guard

    def make():
        piece = asyncio.get_running_loop().create_future()

        async def receive():
            return await piece

        read = Guard(None, ServerOptions(), None)._limited({"headers": []}, receive)()
        return read, lambda: piece.set_result({"type": "http.request", "body": b"x", "more_body": True})

    outcomes = cancel_outcomes(make, 6)
    assert False not in outcomes, f"a cancel taken by the read was swallowed ({outcomes}: turns after the piece)"
    assert outcomes[0] and outcomes[-1] is None
