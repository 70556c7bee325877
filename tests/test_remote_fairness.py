"""The encoder service's fair queue and text batching, without HTTP.

Round-robin order across clients, no starvation under a flood (also when the queue is full), and batched text
encodes bitwise equal to encoding each request alone. Drives `EncoderService` directly on an asyncio loop around
the tiny model's real `EncoderStage`, like tests/test_remote_service.py. Jobs submitted in one turn of the loop are
all queued before the model thread takes the first, which makes the order deterministic.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from support.service_support import run_service

from h3_core.encoder import EncoderStage
from h3_core.models import ModelSource
from h3_core.remote import protocol
from h3_core.remote.protocol import ProtocolError
from h3_core.remote.server import request_schema
from h3_core.remote.server.config import ServerConfig
from h3_core.remote.server.fair_queue import FairQueue
from h3_core.remote.server.service import EncoderService, QueueFull
from h3_core.request import EncodeRequest
from h3_core.text_batching import TextBatcher


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Local reference encodes at the service's thread count (bitwise comparisons)."""


@pytest.fixture(scope="module")
def stage(tiny_dir):
    return EncoderStage(ModelSource.from_path(tiny_dir), components=("text",))


def _prompt(client: str, i: int, words: str = "A red fox trots through fresh snow at dawn") -> str:
    return f"{words}, {client} take {i:05d}."


def _spec(prompt: str):
    return request_schema.parse_request({"protocol": protocol.PROTOCOL_VERSION, "prompt": prompt, "width": 64,
                                   "height": 64, "num_frames": 124})


def _submit(service: EncoderService, client: str, prompt: str):
    spec = _spec(prompt)
    job, _ = service.submit(request_schema.cache_key(spec, {}, service.fingerprint), spec, {}, client=client)
    return job




def _finish_order(jobs: dict[str, object]) -> list[str]:
    """Names of `jobs` in the order their model-thread runs started (one job at a time without batching)."""
    return sorted(jobs, key=lambda name: jobs[name].started)


# --- the queue alone ---------------------------------------------------------------------------------------------


def test_fair_queue_takes_turns_least_recently_served_first():
    queue = FairQueue()
    jobs = [SimpleNamespace(client=c, name=f"{c}{i}") for c, n in (("a", 4), ("b", 2), ("c", 1)) for i in range(n)]
    for job in jobs:
        queue.push(job)
    expected = ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert [job.name for job in queue] == expected  # the order it would serve in, without taking anything
    assert [queue.position(job) for job in jobs] == [expected.index(job.name) for job in jobs]
    assert [queue.pop().name for _ in range(3)] == expected[:3]
    # a client served just now goes behind those served before it; a new client goes first
    queue.push(SimpleNamespace(client="c", name="c1"))
    queue.push(SimpleNamespace(client="d", name="d0"))
    assert [job.name for job in queue] == ["d0", "a1", "b1", "c1", "a2", "a3"]
    assert [queue.pop().name for _ in range(6)] == ["d0", "a1", "b1", "c1", "a2", "a3"]
    assert not queue and len(queue) == 0 and queue.clients() == {}
    with pytest.raises(IndexError):
        queue.pop()


def test_fair_queue_push_out_trims_the_heaviest_client():
    queue = FairQueue()
    flood = [SimpleNamespace(client="flood", name=f"f{i}") for i in range(5)]
    for job in flood:
        queue.push(job)
    queue.push(SimpleNamespace(client="light", name="l0"))
    assert queue.push_out_for("flood") is None  # the heaviest client gets no room from itself
    assert queue.push_out_for("light") is flood[-1]  # 5 >= 1 + 2: the flood's newest job goes
    assert queue.clients() == {"flood": 4, "light": 1}
    balanced = FairQueue()
    for job in (SimpleNamespace(client="x", name="x0"), SimpleNamespace(client="y", name="y0")):
        balanced.push(job)
    assert balanced.push_out_for("y") is None  # nobody holds more than a fair share: the newcomer waits (429)


# --- the service: order and starvation -----------------------------------------------------------------------------


def test_service_serves_clients_round_robin(stage):
    async def body(service: EncoderService):
        jobs = {}
        for client, count in (("a", 3), ("b", 2), ("c", 1)):
            for i in range(count):
                jobs[f"{client}{i}"] = _submit(service, client, _prompt(client, i))
        assert service.queued_clients() == {"a": 3, "b": 2, "c": 1}
        positions = {name: service.queue_position(job) for name, job in jobs.items()}
        await asyncio.gather(*(job.future for job in jobs.values()))
        return _finish_order(jobs), positions

    order, positions = asyncio.run(run_service(stage, ServerConfig(threads=1, text_batch=1), body))
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"]
    assert [name for name, _ in sorted(positions.items(), key=lambda item: item[1])] == order


def test_a_flood_does_not_starve_a_single_request(stage):
    async def body(service: EncoderService):
        flood = [_submit(service, "flood", _prompt("flood", i)) for i in range(24)]
        await asyncio.wait({flood[0].future})  # the flood owns the model thread; a light client arrives now
        light = _submit(service, "light", _prompt("light", 0))
        assert service.queue_position(light) == service.running  # next in line, ahead of 20+ flood jobs
        await light.future
        unfinished = sum(not job.future.done() for job in flood)
        await asyncio.gather(*(job.future for job in flood))
        return unfinished

    unfinished = asyncio.run(run_service(stage, ServerConfig(threads=1, text_batch=1, queue_size=64), body))
    assert unfinished >= 20  # answered while at most one or two flood jobs ran after its arrival


def test_full_queue_makes_room_for_a_light_client(stage):
    async def body(service: EncoderService):
        flood = [_submit(service, "flood", _prompt("flood", i)) for i in range(4)]
        with pytest.raises(QueueFull):
            _submit(service, "flood", _prompt("flood", 4))  # the heaviest client is refused, as before
        light = _submit(service, "light", _prompt("light", 0))  # ... but a light client pushes its newest out
        error = flood[-1].future.exception()
        assert isinstance(error, ProtocolError) and (error.status, error.code) == (429, "queue_full")
        assert service.counters["pushed_out"] == 1 and service.queued_clients() == {"flood": 3, "light": 1}
        await asyncio.gather(light.future, *(job.future for job in flood[:-1]))
        return _finish_order({"light": light, **{f"f{i}": job for i, job in enumerate(flood[:-1])}})

    order = asyncio.run(run_service(stage, ServerConfig(threads=1, text_batch=1, queue_size=4), body))
    assert order.index("light") <= 1


# --- text batching ------------------------------------------------------------------------------------------------


def _request(prompt: str) -> EncodeRequest:
    return EncodeRequest(prompt=prompt, width=64, height=64, num_frames=124)


def test_batched_text_encodes_are_bitwise_equal_to_single_ones(stage):
    batcher = TextBatcher(stage, max_batch=4)
    prompts = [_prompt("b", i) for i in range(6)] + ["A short one."]
    lengths = {batcher.key("t2va", p, False)[1] for p in prompts[:6]}
    assert len(lengths) == 1 and batcher.key("t2va", prompts[-1], False)[1] not in lengths
    assert batcher.key("fl2va", prompts[0], False) is None and batcher.key("t2va", prompts[0], True) is None
    alone = [stage.encode(_request(p)).to_bytes() for p in prompts]
    first = batcher.encode([stage.prepare(_request(p)) for p in prompts])  # shapes met first: checked both ways
    assert batcher.verdicts == {(4, len(_tokens(stage, prompts[0]))): True, (2, len(_tokens(stage, prompts[0]))): True}
    again = batcher.encode([stage.prepare(_request(p)) for p in prompts])  # now batched: 4 + 2, the short one alone
    assert batcher.stats["batched_forwards"] == 2 and batcher.stats["batched_requests"] == 6
    assert [c.to_bytes() for c in first] == alone
    assert [c.to_bytes() for c in again] == alone


def _tokens(stage, prompt):
    return stage.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_service_batches_queued_prompts_of_equal_length(stage):
    seen = []

    async def body(service: EncoderService):
        service.metrics.observe_text_batch = seen.append
        service.batcher.on_forward = seen.append
        results = []
        for round_ in range(2):  # the first batch of a shape is checked against single encodes, the second trusted
            jobs = [_submit(service, f"c{i}", _prompt(f"c{i}", round_)) for i in range(3)]
            jobs.append(_submit(service, "z", "Another prompt, of another length entirely."))
            results.append([(await job.future)[0].tobytes() for job in jobs])
        return results, dict(service.batcher.stats)

    results, stats = asyncio.run(run_service(stage, ServerConfig(threads=1, text_batch=8), body))
    for round_, answers in enumerate(results):
        prompts = [_prompt(f"c{i}", round_) for i in range(3)] + ["Another prompt, of another length entirely."]
        assert answers == [stage.encode(_request(p)).to_bytes() for p in prompts]
    assert stats["batched_forwards"] == 1 and stats["batched_requests"] == 3
    assert sorted(seen) == [1] * 5 + [3]  # round 1: 3 checked singles + 1 alone; round 2: a batch of 3 + 1 alone


def test_a_batch_takes_its_owner_jobs_and_one_per_other_client():
    queue = FairQueue()
    for name in ("l0", "f0", "f1", "f2", "g0", "g1", "l1"):
        queue.push(SimpleNamespace(client=name[0], name=name))
    taken = queue.take_matching(lambda job: True, 5, owner="l")
    assert [job.name for job in taken] == ["l0", "f0", "g0", "l1"]  # one job each of f and g, all of l's own
    assert [job.name for job in queue] == ["f1", "g1", "f2"]


def test_bench_clients_reach_the_server_as_distinct_clients(stage):
    """bench/fairness.py tells its simulated clients apart by loopback source address (127.0.x.y)."""
    from bench import fairness
    from h3_core.remote.engines.aiohttp_server import ServerThread

    with ServerThread(stage, ServerConfig(threads=1)) as server:
        seen = []
        submit = server.service.submit

        def recording(key, spec, parts, client="", **options):
            seen.append(client)
            return submit(key, spec, parts, client=client, **options)

        server.call(lambda: setattr(server.service, "submit", recording))
        result = fairness.many(server.url, "fair", 3, 2, [0])
        assert len(result["latencies"]) == 6 and result["batching"]["requests"] == 6
        fairness.single(server.url, "fifo", 1, [100])
    assert sorted(set(seen)) == ["127.0.0.1", "127.0.10.2", "127.0.10.3", "127.0.10.4"]


def test_scheduling_flags_and_client_keys():
    from h3_core.cli import build_parser
    from h3_core.remote.engines.aiohttp_server import config_from_args

    args = build_parser().parse_args(["serve", "--models", "x", "--client-key", "forwarded", "--text-batch", "1"])
    config = config_from_args(args, None)
    assert (config.client_key, config.text_batch) == ("forwarded", 1)
    service = EncoderService(None, config)
    assert not service.ready and service.client_key("127.0.0.1", "6.6.6.6, 10.0.0.7") == "10.0.0.7"
    assert service.client_key("10.0.0.9", "10.0.0.7") == "10.0.0.9"  # only a loopback proxy is believed
    assert EncoderService(None, ServerConfig()).client_key("127.0.0.1", "10.0.0.7") == "127.0.0.1"
