"""The OpenAI-compatible server, driven by the `openai` client over 127.0.0.1: continuous batching against
Transformers' greedy tokens, streaming, cancellation, backpressure, bad requests, shutdown."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import SERVE_EXPORT, build_tiny_checkpoint
from optimum_neuronx import NeuronModelForCausalLM
from serving import Server, alive, byte_tokenizer, engine_pids, serve_command

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
openai = pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
httpx = pytest.importorskip("httpx2")  # the openai client's HTTP library

pytestmark = pytest.mark.slow  # an export and server processes
SLOTS, WAITING, NAME = SERVE_EXPORT["batch_size"], 2, "tiny-chat"


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer and a chat template."""
    directory = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-chat"))
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def serve_export(chat_checkpoint, tmp_path_factory):
    """SERVE_EXPORT of the chat checkpoint, saved (the server loads it as an export, no compile)."""
    directory = tmp_path_factory.mktemp("serve-export") / "tiny-chat"
    NeuronModelForCausalLM.from_pretrained(chat_checkpoint, export=True, **SERVE_EXPORT).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(serve_export, tmp_path_factory):
    server = Server(serve_command("--model", str(serve_export), "--served_model_name", NAME, "--max_waiting",
                                  str(WAITING)), tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_checkpoint).eval()
    tokenizer = byte_tokenizer()

    def greedy(prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
        """Transformers' greedy continuation (up to EOS, excluded) as text and ids."""
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
        new = out[0, len(prompt_ids):].tolist()
        new = new[:new.index(2)] if 2 in new else new
        return tokenizer.decode(new, skip_special_tokens=True), new

    return greedy


def _prompts(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of mixed lengths: some prompts take two or three prefill chunks of 16."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    outputs = torch.randint(4, 20, (count,), generator=generator).tolist()
    return [(torch.randint(3, 256, (n,), generator=generator).tolist(), m) for n, m in zip(lengths, outputs)]


def _complete(client, prompt, max_tokens, **kwargs):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [NAME]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok"


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_metrics_count_requests_tokens_and_latencies(server):
    before = {name: _metric(server, f"optimum_neuronx_{name}") for name in (
        "requests_total", "generation_tokens_total", "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count")}
    reply = _complete(server.client(), [5, 6, 7], 8, extra_body={"ignore_eos": True})
    after = {name: _metric(server, f"optimum_neuronx_{name}") for name in before}
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["generation_tokens_total"] == before["generation_tokens_total"] + reply.usage.completion_tokens == \
        before["generation_tokens_total"] + 8
    assert after["time_to_first_token_seconds_count"] == before["time_to_first_token_seconds_count"] + 1
    assert after["inter_token_latency_seconds_count"] == before["inter_token_latency_seconds_count"] + 7
    text = httpx.get(f"{server.url}/metrics").text
    for gauge in ("requests_in_flight", "requests_running", "requests_waiting"):
        assert f"optimum_neuronx_{gauge} " in text


def test_concurrent_requests_equal_each_alone_and_transformers(server, reference):
    # 16 requests at once on 4 slots (+2 waiting: the client retries the 429s, as deployments do), then each alone.
    client = server.client(max_retries=50)
    requests = _prompts(16)
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda r: _complete(client, *r), requests))
    alone = [_complete(client, *r) for r in requests]
    for (prompt, max_tokens), mixed, single in zip(requests, together, alone):
        text, ids = reference(prompt, max_tokens)
        assert mixed.choices[0].text == single.choices[0].text == text
        assert mixed.usage.completion_tokens == len(ids) and mixed.usage.prompt_tokens == len(prompt)
        assert mixed.choices[0].finish_reason == ("length" if len(ids) == max_tokens else "stop")
    assert len({r.id for r in together}) == 16


def _stream_times(client, prompt, max_tokens, record: dict, key: str):
    """Stream a completion; record[key]: when its first token and its end came (time.monotonic()), its finish."""
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    times = record.setdefault(key, {})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and "first" not in times:
            times["first"] = time.monotonic()
        if chunk.choices and chunk.choices[0].finish_reason:
            times["finish"] = chunk.choices[0].finish_reason
    times["done"] = time.monotonic()


def test_a_late_request_gets_its_first_token_before_the_others_finish(server):
    # The streams are read on one event loop, so each chunk is timed as it arrives (threads contending for the GIL
    # would time some chunks late); the early requests decode 200 steps, so a busy machine delaying the late
    # request's round trip cannot let them finish first.
    import asyncio

    async def stream(client, prompt, max_tokens, times: dict):
        chunks = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text and "first" not in times:
                times["first"] = time.monotonic()
            if chunk.choices and chunk.choices[0].finish_reason:
                times["finish"] = chunk.choices[0].finish_reason
        times["done"] = time.monotonic()

    async def run() -> dict:
        record = {i: {} for i in (0, 1, 2, "late")}
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            early = [asyncio.create_task(stream(client, [5 + i] * 8, 200, record[i])) for i in range(3)]
            while not all("first" in record[i] for i in range(3)):
                await asyncio.sleep(0.005)
            await stream(client, [9, 9, 9], 3, record["late"])
            await asyncio.gather(*early)
        return record

    record = asyncio.run(run())
    assert all(record[i]["finish"] == "length" for i in range(3))
    assert record["late"]["first"] < min(record[i]["done"] for i in range(3))


def test_streaming_text_equals_non_streaming(server):
    client = server.client()
    prompt = "Once upon a time"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    parts = [c.choices[0].text for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].text
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chat.choices[0].message.role == "assistant"


def test_raw_stream_ends_with_done(server):
    body = {"model": NAME, "prompt": "abc", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data:"):])["choices"][0]["finish_reason"] is not None


def _running(server) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("optimum_neuronx_requests_in_flight ")))


def test_a_client_that_disconnects_frees_its_slot(server):
    body = {"model": NAME, "prompt": [7] * 10, "max_tokens": 50, "temperature": 0, "stream": True,
            "ignore_eos": True}
    for _ in range(SLOTS):  # every slot taken, each client gone after its first token
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0
    reply = _complete(server.client(), [8] * 5, 3)  # served at once
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_seeded_sampling_repeats(server):
    client = server.client()

    def sample(seed):
        return client.completions.create(model=NAME, prompt="Hello", max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"top_k": 20}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_past_the_slots_and_queue_requests_get_429_with_retry_after(server):
    client, count = server.client(), 3 * (SLOTS + WAITING)

    def call(_):
        try:
            return _complete(client, [6] * 4, 60, extra_body={"ignore_eos": True})
        except openai.RateLimitError as err:
            return err

    with ThreadPoolExecutor(count) as pool:
        replies = list(pool.map(call, range(count)))
    refused = [r for r in replies if isinstance(r, openai.RateLimitError)]
    served = [r for r in replies if not isinstance(r, Exception)]
    assert len(served) + len(refused) == count and len(served) >= SLOTS + WAITING and refused
    assert all(r.choices[0].finish_reason == "length" for r in served)
    assert refused[0].response.headers["retry-after"] == "1" and "limit" in refused[0].message
    assert _complete(client, "hi", 2).choices  # still serving


@pytest.mark.parametrize("options, field, named", [
    (dict(prompt=[5] * 200, max_tokens=60), "max_tokens", "sequence_length (256)"),
    (dict(model="other"), "model", "tiny-chat"),
    (dict(n=2), "n", "n=1 only"),
    (dict(logprobs=2), "logprobs", "not supported"),
    (dict(extra_body={"top_k": -2}), "top_k", ">= -1"),
    (dict(temperature=3), "temperature", "between 0 and 2"),
    (dict(prompt=[5, 300]), "prompt", "vocabulary (0 to 255)"),
    (dict(seed=-3), "seed", "between 0 and"),
    (dict(stop=["x" * 600]), "stop", "at most 512 characters"),
])
def test_bad_requests_get_400_naming_the_field_and_the_limit(server, options, field, named):
    client = server.client()
    arguments = {"model": NAME, "prompt": "hi", "max_tokens": 4, **options}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**arguments)
    assert named in refused.value.message and refused.value.body["param"] == field
    assert _complete(client, "hi", 2).choices  # still serving


def test_bodies_past_the_limit_get_413_and_the_server_keeps_serving(server):
    from optimum_neuronx.server.protocol import MAX_BODY_BYTES

    huge = b'{"model": "tiny-chat", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    reply = httpx.post(f"{server.url}/v1/completions", content=huge, headers={"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code == 413 and "larger than this server takes" in reply.json()["error"]["message"]
    reply = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=60)
    assert reply.status_code == 400 and "not JSON" in reply.json()["error"]["message"]
    assert _complete(server.client(), "hi", 2).choices


def test_flags_an_export_was_not_compiled_for_are_refused(serve_export, tmp_path):
    import subprocess

    result = subprocess.run(serve_command("--model", str(serve_export), "--batch_size", "8"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert "--batch_size 8 (compiled: 4)" in result.stderr
    assert "--batch_size 4 --sequence_length 256 --tensor_parallel_size 1" in result.stderr
    static = tmp_path / "static"  # an export without prefill graphs: only its neuron_config.json is read
    static.mkdir()
    meta = json.loads((serve_export / "neuron_config.json").read_text())
    meta["neuron_config"]["continuous_batching"] = False
    (static / "neuron_config.json").write_text(json.dumps(meta))
    result = subprocess.run(serve_command("--model", str(static)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--continuous_batching" in result.stderr


def test_sigterm_drains_requests_in_flight_and_sigkill_leaves_no_engine(serve_export, tmp_path):
    server = Server(["optimum-cli", "neuron", "serve", "--model", str(serve_export), "--served_model_name", NAME],
                    tmp_path / "server.log")
    engines = engine_pids(server.process.pid)
    assert len(engines) == 1 and alive(engines[0])
    client, record = server.client(), {}
    thread = threading.Thread(target=_stream_times, args=(client, [4] * 6, 40, record, "drained"))
    thread.start()
    while "first" not in record.get("drained", {}):
        time.sleep(0.01)
    assert server.stop(signal.SIGTERM) == 0  # returns once the request in flight has finished
    thread.join()
    assert record["drained"]["finish"] == "length"  # all 40 tokens
    assert not any(alive(pid) for pid in engines)

    server = Server(serve_command("--model", str(serve_export), "--served_model_name", NAME), tmp_path / "k.log")
    engines = engine_pids(server.process.pid)
    assert len(engines) == 1
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in engines), "the engine outlived its server"


def test_two_ray_serve_replicas_behind_one_endpoint(chat_checkpoint, reference, tmp_path):
    # The checkpoint itself: each replica's engine exports it (through the compile cache: one compiles, the other
    # waits for it and loads the entry), with default buckets; no waiting queue, so Ray's own queue answers 429.
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    server = Server(serve_command("--model", str(chat_checkpoint), "--served_model_name", NAME, "--replicas", "2",
                                  "--batch_size", str(SLOTS), "--sequence_length", "64", "--max_waiting", "0"),
                    tmp_path / "ray.log", env={"RAY_USAGE_STATS_ENABLED": "0"})  # (no network here)
    try:
        pids = {httpx.get(f"{server.url}/health", timeout=30).json()["pid"] for _ in range(40)}
        assert len(pids) == 2, pids  # two engines behind the one endpoint
        client = server.client(max_retries=50)
        requests = _prompts(8, seed=1)
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda r: _complete(client, *r), requests))
        for (prompt, max_tokens), reply in zip(requests, replies):
            assert reply.choices[0].text == reference(prompt, max_tokens)[0]

        def call(_):
            try:
                return _complete(server.client(), [6] * 4, 60, extra_body={"ignore_eos": True})
            except openai.RateLimitError as err:
                return err

        with ThreadPoolExecutor(40) as pool:
            results = list(pool.map(call, range(40)))
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert refused and all(r.choices[0].finish_reason == "length" for r in results if r not in refused)
        assert refused[0].response.headers["retry-after"] == "1"
    finally:
        assert server.stop(signal.SIGTERM, timeout=180) == 0, server.log()[-3000:]
