"""`mpiexec -n 2 mpdl serve --tp 2` answers the official OpenAI client: greedy and seeded texts
are `mpdl generate`'s, 32 concurrent requests each get their own, a stream gives the same text, bad
requests get a 400 naming the field, and a client that goes away frees its pages."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mpdl.models.gpt import GPT
from mpdl.training.checkpoint import save_checkpoint

openai = pytest.importorskip("openai")

BIN = Path(sys.executable).parent
VOCAB = " abcdefghijklmnopqrstuvwxyz.,"
BLOCK = 32
PROMPTS = [" ".join(["the cat", "a dog", "sat on", "my hat", "we go", "zebra"][i % 6]
                    for _ in range(1 + i % 3)) + VOCAB[1 + i % 26] for i in range(32)]


def checkpoint(directory: Path) -> None:
    gpt = GPT(len(VOCAB), BLOCK, 2, 4, 16, seed=7)
    rng = np.random.default_rng(7)
    for name, p in gpt.named_parameters():  # wide embeddings: texts that differ by prompt
        p.data[...] = rng.normal(0, 1.0 if "embedding" in name else 0.3, p.shape)
    info = {"name": "gpt", "vocab": VOCAB, "block_size": BLOCK, "n_layer": 2, "n_head": 4,
            "n_embd": 16, "dtype": "float32"}
    save_checkpoint(directory, gpt.state_dict(), {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "model_info": info, "config": {"model": "gpt"}})


def generate(ckpt: Path, *flags: str) -> list[str]:
    out = subprocess.run([str(BIN / "mpdl"), "generate", "--checkpoint", str(ckpt), *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_serve_over_tp_2_answers_the_openai_client(tmp_path):
    checkpoint(tmp_path / "ckpt")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    port = free_port()
    server = subprocess.Popen([str(BIN / "mpiexec"), "-n", "2", str(BIN / "mpdl"), "serve",
                               "--checkpoint", str(tmp_path / "ckpt"), "--tp", "2", "--port",
                               str(port), "--page-size", "4", "--max-batch", "16"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        greedy = generate(tmp_path / "ckpt", "--prompts", str(tmp_path / "prompts.txt"),
                          "--max-new-tokens", "12", "--top-k", "1")[:len(PROMPTS)]
        sampled = generate(tmp_path / "ckpt", "--prompt", PROMPTS[5], "--max-new-tokens", "40",
                           "--temperature", "0.8", "--seed", "11")[0]
        assert len({g[len(p):] for g, p in zip(greedy, PROMPTS, strict=True)}) > 4
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if get(base + "/health")["status"] == "ok":
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 120 s"
                time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["ckpt"]

        def complete(prompt: str) -> str:
            r = client.completions.create(model="ckpt", prompt=prompt, max_tokens=12,
                                          temperature=0)
            assert r.choices[0].finish_reason == "length"
            return r.choices[0].text

        assert complete(PROMPTS[0]) == greedy[0][len(PROMPTS[0]):]
        with ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert [p + t for p, t in zip(PROMPTS, texts, strict=True)] == greedy
        r = client.completions.create(model="ckpt", prompt=PROMPTS[5], max_tokens=40,
                                      temperature=0.8, seed=11)  # past the block: a window
        assert PROMPTS[5] + r.choices[0].text == sampled
        pieces = [c.choices[0].text for c in client.completions.create(
            model="ckpt", prompt=PROMPTS[3], max_tokens=12, temperature=0, stream=True)]
        assert len(pieces) == 12 and PROMPTS[3] + "".join(pieces) == greedy[3]
        for kwargs, param in [({"max_tokens": -5}, "max_tokens"),
                              ({"prompt": "THE CAT"}, "prompt"),
                              ({"prompt": "a" * (BLOCK + 1)}, "prompt"),
                              ({"extra_body": {"top_p": 0}}, "top_p")]:
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**{"model": "ckpt", "prompt": "a", **kwargs})
            assert err.value.status_code == 400 and err.value.body["param"] == param
        stream = client.completions.create(model="ckpt", prompt="a", max_tokens=4000,
                                           temperature=0, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
        while (m := get(base + "/metrics"))["kv_pages_in_use"] or not m["cancelled"]:
            assert time.monotonic() < deadline + 120, m
            time.sleep(0.2)
        assert m["finished"] >= 35 and m["rejected"] == 4 and m["latency_p99_s"] > 0
        assert server.poll() is None
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_serve_refuses_bad_flags_in_one_line(tmp_path):
    checkpoint(tmp_path / "ckpt")
    for flags, message in [(["--kv-pages", "7"], "--kv-pages: expected at least a block's worth, "
                            "8 pages of 4 positions for the block of 32, got 7"),
                           (["--tp", "3"], "--tp: 3 tensor-parallel ranks must divide the model's "
                            "4 heads"),
                           (["--max-batch", "0"], "--max-batch: expected a positive number, got 0")]:
        out = subprocess.run([str(BIN / "mpdl"), "serve", "--checkpoint", str(tmp_path / "ckpt"),
                              "--port", str(free_port()), "--page-size", "4", *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert message in out.stderr, out.stderr


def _post(base: str, raw: str) -> tuple[int, dict]:
    request = urllib.request.Request(base + "/v1/completions", data=raw.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_serve_refuses_unknown_fields_non_finite_numbers_and_other_models_and_cancels_a_client_that_leaves(tmp_path):  # noqa: E501
    """One rank. NaN and Infinity (which Python's JSON reader takes), an unknown field, max_tokens
    above --max-tokens: 400 naming the field; another model: 404 model_not_found. A client that
    leaves a non-streamed request is cancelled while tokens keep coming: nothing runs and no
    token is made 5 s later, and its pages are free; so is one that leaves a stream."""
    checkpoint(tmp_path / "ckpt")
    port = free_port()
    server = subprocess.Popen([str(BIN / "mpdl"), "serve", "--checkpoint", str(tmp_path / "ckpt"),
                               "--port", str(port), "--page-size", "4", "--max-tokens", "100000"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if get(base + "/health")["status"] == "ok":
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 120 s"
                time.sleep(0.5)
        for raw, status, param, words in [
                ('{"prompt": "a", "temperature": NaN}', 400, "temperature", "NaN or Infinity"),
                ('{"prompt": "a", "top_p": Infinity}', 400, "top_p", "NaN or Infinity"),
                ('{"prompt": "a", "stop": ["x"], "max_tokens": 3, "seed": -Infinity}', 400, "seed",
                 "NaN or Infinity"),
                ('{"prompt": "a", "max_token": 5}', 400, "max_token",
                 "Unrecognized request argument supplied: max_token"),
                ('{"prompt": "a", "max_tokens": 100001}', 400, "max_tokens", "<= 100000"),
                ('{"model": "gpt-4", "prompt": "a"}', 404, "model", "`gpt-4` does not exist")]:
            code, body = _post(base, raw)
            assert code == status and body["error"]["param"] == param, (raw, code, body)
            assert words in body["error"]["message"], body
        assert _post(base, '{"model": "gpt-4", "prompt": "a"}')[1]["error"]["code"] == \
            "model_not_found"
        code, body = _post(base, '{"model": "ckpt", "prompt": "a", "max_tokens": 3}')
        assert code == 200 and body["choices"][0]["finish_reason"] == "length"
        raw = json.dumps({"prompt": "a", "max_tokens": 100000, "temperature": 0})
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n{raw}".encode())
            while (m := get(base + "/metrics"))["tokens"] < 50:
                assert time.monotonic() < deadline + 60, m
                time.sleep(0.1)
            assert m["running"] == 1, m
        time.sleep(5)
        m = get(base + "/metrics")
        assert (m["running"], m["waiting"], m["cancelled"], m["kv_pages_in_use"]) == (0, 0, 1, 0), m
        time.sleep(1)
        assert get(base + "/metrics")["tokens"] == m["tokens"]
        raw = json.dumps({"prompt": "a", "max_tokens": 100000, "temperature": 0, "stream": True})
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           f"application/json\r\nContent-Length: {len(raw)}\r\n\r\n{raw}".encode())
            got = b""
            while b"data: " not in got:  # the stream has begun (the socket's timeout bounds it)
                chunk = client.recv(4096)
                assert chunk, got
                got += chunk
        time.sleep(5)
        m = get(base + "/metrics")
        assert (m["running"], m["cancelled"], m["kv_pages_in_use"]) == (0, 2, 0), m
        assert server.poll() is None
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
