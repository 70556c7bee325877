"""Hostile JSON against the real encoder server (the tiny H3, one server for the module): no JSON makes a 5xx.

`hostile_requests(seed)` makes, deterministically, at least 400 request bodies: every numeric field (protocol,
num_frames, width, height, deadline_s, a reference video's fps) with wrong types, booleans, negatives, zero, huge
integers (10**20 .. 10**5000), huge and tiny floats (1e308, 1e400 -> inf, 5e-324), NaN / Infinity literals; the
other fields with wrong types, long strings, surrogates and NULs; missing and unknown fields, duplicate keys, deep
nesting, broken UTF-8 and truncated JSON; both as application/json and as the JSON part of a multipart body.

Every answer is below 500; every refusal is a JSON error with a code and a message, and a mutation of one field of
an otherwise valid request is refused naming that field. Before this module's fixes, a deadline_s or fps of 10**400
was a 500 with a logged traceback (OverflowError) and 1e400 or NaN anywhere was refused without naming the field.
"""

from __future__ import annotations

import http.client
import json
import math
import random
from dataclasses import dataclass

import pytest

from h3_core.remote import protocol
from h3_core.remote.engines.aiohttp_server import ServerThread
from h3_core.remote.server.config import ServerConfig

SEED = 20261206
BASE = {"protocol": 2, "prompt": "A red fox in the snow.", "width": 64, "height": 64, "num_frames": 124}
# A valid reference-video request, answered 400 "send multipart" once its JSON passes: exercises fps with no encode.
VIDEO_BASE = {**BASE, "ref_videos": [{"part": "v", "fps": 24}]}


@dataclass(frozen=True)
class Case:
    label: str
    body: bytes
    field: str | None = None  # the field a refusal must name (None: any field, or none, with a code)
    multipart: bool = False


def _raw(obj, raws: dict[str, str]) -> bytes:
    """`obj` as JSON with every "__RAWn__" string replaced by its raw literal (numbers json.dumps cannot write:
    NaN, 1e400, ints of thousands of digits)."""
    text = json.dumps(obj)
    for key, literal in raws.items():
        text = text.replace(json.dumps(key), literal)
    return text.encode("utf-8", "surrogatepass")


def _big(digits: int, sign: str = "") -> str:
    return sign + "1" + "0" * digits


NUMBER_LITERALS = [
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e309", "1.7976931348623157e308", "5e-324", "1e-400",
    "0", "-0", "-1", "0.0", "-0.0", "0.5", "123.5", "124.0", "2147483648", "9223372036854775808",
    _big(19), _big(20), _big(64), _big(65), _big(300), _big(400), _big(400, "-"), _big(4299), _big(5000),
]
WRONG_TYPES = ["true", "false", "null", '"24"', '""', "[]", "{}", "[1]", '{"a": 1}', '"NaN"', '"1e400"']
NUMERIC_FIELDS = ["protocol", "num_frames", "width", "height", "deadline_s"]


def _numeric_cases() -> list[Case]:
    cases = []
    for field in NUMERIC_FIELDS:
        for literal in NUMBER_LITERALS + WRONG_TYPES:
            body = _raw({**BASE, field: "__RAW0__"}, {"__RAW0__": literal})
            cases.append(Case(f"{field}={literal[:16]}", body, field))
    for literal in NUMBER_LITERALS + WRONG_TYPES + ["241", "240.0001", "1e-9"]:
        video = {**VIDEO_BASE, "ref_videos": [{"part": "v", "fps": "__RAW0__"}]}
        # a valid fps (null: the container's) passes, and the request is refused later for its missing part
        field = None if _fps_ok(literal) else "ref_videos[0].fps"
        cases.append(Case(f"fps={literal[:16]}", _raw(video, {"__RAW0__": literal}), field))
    return cases


def _fps_ok(literal: str) -> bool:
    if len(literal) > 64:  # longer than any honest number (and past 4300 digits json.loads itself refuses it)
        return False
    value = json.loads(literal)  # Python's reader takes NaN and reads 1e400 as inf: both refused below
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):  # (math.isfinite of a 400-digit int overflows)
        return False
    return 0 < value <= protocol.Limits().max_fps


def _string_cases(rng: random.Random) -> list[Case]:
    cases = []
    texts = ["", " ", "\u0000", "\ud800", "x" * 16385, "x" * 70000, "é" * 20000, "<|vision_start|>" * 2000]
    for field, values in (("prompt", texts + [5, 1.5, True, None, [], {}, ["a"]]),
                          ("task", ["i2v", "T2VA", "x" * 5000, 5, True, [], {}, "\ud800", "ref2va", "fl2va"]),
                          ("model", ["not hex", "A" * 64, "0" * 65, 5, True, [], {}, "\u0000"])):
        for value in values:
            obj = {**BASE, field: value}
            body = json.dumps(obj).encode("utf-8", "surrogatepass")
            # over max_json_bytes, the JSON part is refused whole (413 on "request") before any field is read
            named = "request" if len(body) > protocol.Limits().max_json_bytes else field
            cases.append(Case(f"{field}={str(value)[:16]!r}", body, named if field != "task" else None))
    for _ in range(24):  # random unicode prompts over the limit
        length = rng.choice([16385, 20000, 30000])
        text = "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(length))
        body = json.dumps({**BASE, "prompt": text}, ensure_ascii=False).encode("utf-8", "surrogatepass")
        cases.append(Case("prompt=long unicode", body, None))  # 413 on the prompt, or on the JSON's size
    return cases


def _media_cases() -> list[Case]:
    cases = []
    parts = [5, None, True, "", "..", "../etc/passwd", "request", "x" * 65, "a/b", "\u0000", [], {}, "ok"]
    for key in ("first_frame", "last_frame"):
        for value in [5, "x", [], True, {"part": 5}, {"part": "ok", "fps": 24}, {}, {"part": "ok", "x": 1}]:
            cases.append(Case(f"{key}={value!r:.20}", json.dumps({**BASE, key: value}).encode(), None))
    for key in ("ref_images", "ref_videos", "ref_audios"):
        for value in ["x", 5, {}, True, [5], [None], [[]], [{"part": p} for p in parts],
                      [{"part": f"p{i}"} for i in range(17)], [{"part": f"p{i}"} for i in range(10)],
                      [{"part": "a"}, {"part": "a"}]]:
            cases.append(Case(f"{key}={str(value)[:20]}", json.dumps({**BASE, key: value}).encode(), None))
        for part in parts:
            cases.append(Case(f"{key}.part={part!r:.20}", json.dumps({**BASE, key: [{"part": part}]}).encode(), None))
    for value in [True, 5, [], {}, "..", "request", "v", "x" * 65, 1.5]:
        video = {**VIDEO_BASE, "ref_videos": [{"part": "v", "soundtrack": value}]}
        cases.append(Case(f"soundtrack={value!r:.20}", json.dumps(video).encode(), None))
    return cases


def _structure_cases(rng: random.Random) -> list[Case]:
    cases = [Case(f"top={text[:12]!r}", text.encode(), "request") for text in (
        "", " ", "null", "5", '"x"', "[]", "[1, 2]", "true", "{", '{"protocol": 2,', "}", "{}}", "\ufeff{}",
        '{"protocol": 2, "prompt": "a" "b"}', "{'protocol': 2}", '{"protocol": 2, "prompt": "A fox."} x')]
    cases += [Case("utf8", data, "request") for data in (b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"\x00" * 10,
                                                           b'{"protocol": 2, "prompt": "\xed\xa0\x80"}')]
    for depth in (10, 100, 500, 999, 1000, 1001, 5000, 30000):
        for opener, closer in (("[", "]"), ('{"a":', "}")):
            nested = opener * depth + "1" + closer * depth
            cases.append(Case(f"depth {depth} {opener}", _raw({**BASE, "prompt": "__RAW0__"}, {"__RAW0__": nested}),
                              None))
            cases.append(Case(f"top depth {depth} {opener}", nested.encode(), None))
    for field in ("protocol", "prompt"):
        missing = {key: value for key, value in BASE.items() if key != field}
        cases.append(Case(f"missing {field}", json.dumps(missing).encode(), field))
    for key in ("extra", "", "x" * 5000, "\ud800", "__proto__", "Protocol", "num_frame", "0"):
        body = json.dumps({**BASE, key: 1}).encode("utf-8", "surrogatepass")
        cases.append(Case(f"extra {key[:12]!r}", body, "the request"))
    cases.append(Case("duplicate key", b'{"protocol": 2, "protocol": 2, "prompt": "A fox."}', "request"))
    cases.append(Case("too large", json.dumps({**BASE, "pad": "x" * 70000}).encode(), "request"))
    for _ in range(40):  # random byte flips in a valid request
        data = bytearray(json.dumps(VIDEO_BASE).encode())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append(Case("flipped bytes", bytes(data), None))
    return cases


def _combined_cases(rng: random.Random) -> list[Case]:
    """Several faults at once: fields and hostile values drawn from the pools above."""
    cases = []
    pool = NUMBER_LITERALS + WRONG_TYPES
    for _ in range(60):
        obj, raws = dict(VIDEO_BASE), {}
        for index, field in enumerate(rng.sample(NUMERIC_FIELDS + ["fps"], rng.randint(2, 4))):
            key = f"__RAW{index}__"
            raws[key] = rng.choice(pool)
            if field == "fps":
                obj["ref_videos"] = [{"part": "v", "fps": key}]
            else:
                obj[field] = key
        if rng.random() < 0.3:
            del obj["protocol"]
        cases.append(Case("combined", _raw(obj, raws), None))
    return cases


def hostile_requests(seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    cases = _numeric_cases() + _string_cases(rng) + _media_cases() + _structure_cases(rng) + _combined_cases(rng)
    # The same requests again as the JSON part of a multipart body (no media parts: a request naming parts is
    # refused for the missing part after its JSON passed), one in three.
    cases += [Case(case.label + " (multipart)", case.body, case.field, True) for case in cases[::3]]
    return cases


def _multipart(json_part: bytes) -> tuple[str, bytes]:
    boundary = "fuzzb0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"request\"\r\nContent-Type: application/json"
            "\r\n\r\n").encode() + json_part + f"\r\n--{boundary}--\r\n".encode()
    return f"multipart/form-data; boundary={boundary}", body


@pytest.fixture(scope="module")
def server(encoder_stage, one_thread):
    with ServerThread(encoder_stage, ServerConfig(threads=1)) as srv:
        yield srv


def _post(conn: http.client.HTTPConnection, case: Case) -> tuple[int, bytes]:
    content_type, body = _multipart(case.body) if case.multipart else ("application/json", case.body)
    conn.request("POST", protocol.ENCODE_PATH, body=body, headers={"Content-Type": content_type})
    reply = conn.getresponse()
    return reply.status, reply.read()


def test_the_generator_is_deterministic_and_large():
    first, second = hostile_requests(), hostile_requests()
    assert first == second and len(first) >= 400
    assert len({case.body for case in first}) >= 300


def test_no_hostile_json_gets_a_5xx(server):
    cases = hostile_requests()
    host, port = server.url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    statuses: dict[int, int] = {}
    failures = []
    try:
        for case in cases:
            try:
                status, data = _post(conn, case)
            except (http.client.HTTPException, ConnectionError):
                conn.close()  # the server closed after an answer: reconnect and resend once
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                status, data = _post(conn, case)
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500:
                failures.append((case.label, status, data[:300]))
                continue
            if status == 200:
                continue
            error = json.loads(data)["error"]
            if not (isinstance(error.get("code"), str) and error["code"] and error.get("message")):
                failures.append((case.label, status, "no code or message", error))
            elif len(error["message"]) > 1000:
                failures.append((case.label, status, "message over 1000 characters", error["message"][:100]))
            elif case.field is not None and error.get("field") != case.field:
                failures.append((case.label, status, f"names {error.get('field')!r}, not {case.field!r}",
                                 error["message"][:200]))
    finally:
        conn.close()
    print(f"{len(cases)} hostile requests: statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(map(str, failures))
    assert sum(count for status, count in statuses.items() if 400 <= status < 500) >= 400
    assert server.service.counters.get("status_500", 0) == 0
