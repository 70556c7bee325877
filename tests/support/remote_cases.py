"""The encoder endpoint's shared test cases: the parity requests by task, slowed stages, hostile requests.

`CASES` are the canonical requests of `h3_core.testing` keyed by task, except that the ref2va reference video
carries a 44.1 kHz soundtrack (resampled on the server exactly as locally). `SlowStage` delays the work before the
encoders run (queueing, deadlines, cancel); `PacedStage` holds each encoder phase open (progress polls).
`hostile_cases()` builds 500+ hostile requests and `send_hostile` sends them, collecting what was not a clean 4xx.
"""

from __future__ import annotations

import json
import random
import time

from h3_core import media
from h3_core.progress import Cancelled
from h3_core.remote import protocol
from h3_core.request import EncodeRequest, VideoInput
from h3_core.testing import CASES as PARITY_CASES
from h3_core.testing import image, png_bomb, ref2va_request, tone, video

from . import remote_http


def _ref2va_with_a_44k_soundtrack() -> EncodeRequest:
    request = ref2va_request()
    clip = video(2.0, audio=False)
    soundtrack = VideoInput(frames=clip.frames, fps=clip.fps, audio=tone(2.0, 44100, 220.0), sample_rate=44100)
    return EncodeRequest(**{**request.__dict__, "ref_videos": [soundtrack]})


CASES = {
    "t2va": PARITY_CASES["t2va-64x64-seed0"][0],
    "fl2va": PARITY_CASES["fl2va-first-last-seed1"][0],
    "ref2va": _ref2va_with_a_44k_soundtrack(),
}


class SlowStage:
    """The real stage behind a cancellable delay: makes queueing, deadlines and cancel deterministic."""

    def __init__(self, stage, delay):
        self.stage, self.delay = stage, delay
        self.fingerprint, self.components = stage.fingerprint, stage.components
        self.calls = self.cancelled = 0

    def encode(self, request, metadata=None, cancel=None, progress=None):
        self.calls += 1
        end = time.monotonic() + self.delay
        while time.monotonic() < end:
            if cancel is not None and cancel.is_set():
                self.cancelled += 1
                raise Cancelled("cancelled during the test delay")
            time.sleep(0.005)
        return self.stage.encode(request, metadata=metadata, cancel=cancel, progress=progress)


class PacedStage:
    """The real stage; each encoder phase (and the end of the last one) is held open for `pause` seconds."""

    def __init__(self, stage, pause=0.35):
        self.stage, self.pause = stage, pause
        self.fingerprint, self.components = stage.fingerprint, stage.components
        self.pipeline_config = getattr(stage, "pipeline_config", None)

    def encode(self, request, metadata=None, cancel=None, progress=None):
        def paced(done, total, *args, **kwargs):
            if progress is not None:
                progress(done, total, *args, **kwargs)
            time.sleep(self.pause)

        return self.stage.encode(request, metadata=metadata, cancel=cancel, progress=paced)


# --- hostile input -------------------------------------------------------------------------------


def _multipart(parts, boundary="hostileBoundary123"):
    out = []
    for headers, data in parts:
        out.append(b"--" + boundary.encode() + b"\r\n" + "\r\n".join(headers).encode("latin-1") + b"\r\n\r\n"
                   + data + b"\r\n")
    out.append(b"--" + boundary.encode() + b"--\r\n")
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def _json_part(obj_or_raw):
    raw = obj_or_raw if isinstance(obj_or_raw, bytes) else json.dumps(obj_or_raw).encode()
    return (['Content-Disposition: form-data; name="request"', "Content-Type: application/json"], raw)


def _media_part(name, content_type, data, filename=None):
    disposition = f'Content-Disposition: form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return ([disposition, f"Content-Type: {content_type}"], data)


def hostile_cases() -> list[tuple[str, str, str, dict, bytes]]:
    """500+ hostile requests, (label, method, path, headers, body): garbage, wrong types, truncation, huge sizes,
    bad JSON, out-of-range fields, unsafe names, lying media. Every one must get a 4xx with a JSON error."""
    rng = random.Random(1234)
    png = media.encode_png_bytes(image(5, 64, 96))
    wav = media.encode_wav_bytes(tone(2.5), 32000)
    fl2va = {"protocol": 2, "prompt": "The door opens.", "first_frame": {"part": "kf"}}
    cases = []  # (label, method, path, headers, body)

    def post(label, body, content_type, extra=None, path=protocol.ENCODE_PATH):
        headers = {"Content-Type": content_type} if content_type is not None else {}
        cases.append((label, "POST", path, {**headers, **(extra or {})}, body))

    # 1. garbage bodies
    for i in range(40):
        blob = rng.randbytes(rng.randint(0, 3000))
        post(f"garbage multipart {i}", blob, "multipart/form-data; boundary=hostileBoundary123")
    for i in range(25):
        post(f"garbage json {i}", rng.randbytes(rng.randint(1, 500)), "application/json")
    for i in range(30):  # garbage that starts like a multipart body
        post(f"garbage after boundary {i}", b"--hostileBoundary123\r\n" + rng.randbytes(rng.randint(0, 800)),
             "multipart/form-data; boundary=hostileBoundary123")
    # 2. wrong content types / methods / paths
    good_json = json.dumps({"protocol": 2, "prompt": "hi"}).encode()
    for content_type in ("text/plain", "application/xml", "application/x-www-form-urlencoded", "image/png",
                         "application/octet-stream", "multipart/mixed; boundary=x", "multipart/form-data",
                         "multipart/form-data; boundary=", "audio/wav", "video/mp4", "text/html; charset=utf-8",
                         "application/jsonx", "*/*", "application/json-patch+json"):
        post(f"content type {content_type}", good_json, content_type)
        post(f"content type {content_type} (multipart body)", _multipart([_json_part(good_json)])[0], content_type)
    post("no content type", good_json, None)
    body, content_type = _multipart([_json_part(fl2va), _media_part("kf", "image/png", png)])
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        cases.append((f"method {method}", method, protocol.ENCODE_PATH, {"Content-Type": content_type}, body))
    for path in ("/", "/v1", "/v2/encode", "/v1/encode/../capabilities", "/v1/encode%00", "/v1/ENCODE",
                 "/v1/capabilities/x", "/admin", "/%2e%2e/etc/passwd"):
        cases.append((f"path {path}", "POST", path, {"Content-Type": content_type}, body))
    # 3. truncated multipart: a valid fl2va request cut anywhere before the end of the image data
    end = body.index(png) + len(png) - 13
    for cut in sorted(rng.sample(range(1, end), 100)):
        post(f"truncated at {cut}", body[:cut], content_type)
    # 4. huge declared sizes
    for declared in (10**12, 2**63 - 1, 512 * 1024 * 1024 + 1, 10**15, 2**40):
        for payload in (b"", b"x" * 10, body[:100]):
            post(f"declares {declared} bytes", payload, content_type, {"Content-Length": str(declared)})
    for declared in ("-1", "1e9", "0x10", "12 34", "99999999999999999999999"):
        post(f"bad Content-Length {declared}", good_json, "application/json", {"Content-Length": declared})
    # 5. bad JSON (alone and as the multipart request part)
    bad_json = [b"", b"{", b"}", b"[]", b"null", b"1", b'"str"', b"{'protocol': 1}", b'{"protocol": 2,}',
                b'{"protocol": 2 "prompt": "x"}', b'{"protocol": NaN, "prompt": "x"}',
                b'{"protocol": 2, "prompt": Infinity}', b'{"protocol": 2, "prompt": "x", "protocol": 2}',
                b"\xef\xbb\xbf" + good_json, b"\xff\xfe{}", b'{"protocol": 2, "prompt": "\\ud800"}',
                b"[" * 3000 + b"]" * 3000, b'{"a":' * 2000 + b"1" + b"}" * 2000, b'{"protocol": 1e999}',
                b'{"protocol": 2, "prompt": "x"} trailing', b'{"protocol": 2, "prompt": "x\x00"}',
                b"/* comment */ " + good_json, b'{"protocol": 2, "prompt": "x", "num_frames": 1' + b"0" * 5000 + b"}",
                b" " * 70000, b'{"protocol": 2, "prompt": "' + b"y" * 70000 + b'"}']
    bad_json += [good_json[:i] for i in range(1, len(good_json), 2)]
    for i, raw in enumerate(bad_json):
        post(f"bad json {i}", raw, "application/json")
        post(f"bad json part {i}", _multipart([_json_part(raw)])[0], content_type)
    # 6. out-of-range and ill-typed values
    bad_fields = {
        "num_frames": [0, -1, 1, 6, 123, 125, 346, 362, 10**9, 10**30, 1.5, "124", [124], {"n": 1}, True],
        "width": [0, -64, 33, 65, 10**6, 64.0, "64", True],
        "task": ["", "T2VA", "i2v", 1, ["t2va"], "fl2va", "ref2va"],
        "protocol": [0, 1, 3, -1, "2", 2.0, None, True, [2]],
        "prompt": ["", "   ", 123, None, ["x"], {"t": "x"}, "x" * 20000],
        "deadline_s": [0, -5, 10**7, "10", True, [1]],
        "model": ["XYZ", "0" * 65, 12, ["a"]],
        "ref_images": ["a", [1], [{"part": 1}], [{}], [{"part": "a", "x": 1}], [{"part": f"i{i}"} for i in range(10)],
                       {"part": "a"}],
        "ref_videos": [[{"part": "v", "fps": 0}], [{"part": "v", "fps": -24}], [{"part": "v", "fps": 10**6}],
                       [{"part": "v", "fps": "24"}], [{"part": "v", "soundtrack": True}],
                       [{"part": "v", "soundtrack": 3}], [{"part": f"v{i}"} for i in range(4)]],
        "ref_audios": [[{"part": "a"}], [{"part": f"a{i}"} for i in range(4)]],
        "first_frame": ["kf", 1, [], {"part": ""}, {"part": None}],
        "extra_field": [1, "x"],
    }
    for name, values in bad_fields.items():
        for value in values:
            obj = {"protocol": 2, "prompt": "A fox.", name: value}
            if name == "width":
                obj["height"] = 64
            post(f"{name}={str(value)[:40]}", json.dumps(obj).encode(), "application/json")
            if name in ("num_frames", "width", "task", "prompt"):
                raw = json.dumps(obj).encode()
                post(f"{name}={str(value)[:40]} (multipart)", _multipart([_json_part(raw)])[0], content_type)
    for obj in ({"protocol": 2, "prompt": "x", "width": 64},  # width without height
                {"protocol": 2, "prompt": "x", "width": 128, "height": 16},  # aspect 8:1
                {"protocol": 2, "prompt": "x", "task": "t2va", "first_frame": {"part": "kf"}},
                {"protocol": 2, "prompt": "x", "first_frame": {"part": "a"}, "last_frame": {"part": "b"},
                 "ref_images": [{"part": "c"}]},
                {"protocol": 2, "prompt": "x", "ref_images": [{"part": f"i{i}"} for i in range(9)],
                 "ref_videos": [{"part": f"v{i}"} for i in range(3)], "ref_audios": [{"part": "a"}]}):
        post(f"rule {sorted(obj)}", json.dumps(obj).encode(), "application/json")
    # 7. unsafe part and file names
    for name in ("../kf", "/etc/passwd", "a b", "..", "a/../b", "x" * 65, "ü", "C:\\kf", "kf\n", "", ".kf", "-kf"):
        obj = dict(fl2va, first_frame={"part": name})
        post(f"part name {name!r}", *_multipart([_json_part(obj), _media_part("kf", "image/png", png)]))
    for filename in ("../../etc/passwd", "/abs/x.png", "a\\\\b.png", "x\x01.png", "..", ".htaccess",
                     "a/b.png", "x" * 300, "ok/../x.png", "C:/x.png"):
        post(f"filename {filename[:30]!r}",
             *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png, filename)]))
    for name in ("../../x", "other", "kf2", "request", "KF"):
        post(f"undeclared part {name!r}",
             *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png), _media_part(name, "image/png", png)]))
    post("duplicate part", *_multipart([_json_part(fl2va), _media_part("kf", "image/png", png),
                                        _media_part("kf", "image/png", png)]))
    post("missing part", *_multipart([_json_part(fl2va)]))
    post("media before request", *_multipart([_media_part("kf", "image/png", png), _json_part(fl2va)]))
    post("request part not json", *_multipart([(['Content-Disposition: form-data; name="request"',
                                                  "Content-Type: text/plain"], json.dumps(fl2va).encode())]))
    # 8. media that lies about itself
    bomb = png_bomb(60000, 60000)  # a valid header claiming 3.6 gigapixels
    media_cases = [("image/jpeg", png), ("image/gif", png), ("text/plain", png), ("application/octet-stream", png),
                   ("image/png", rng.randbytes(2000)), ("image/png", png[:8] + rng.randbytes(500)),
                   ("image/png", png[: len(png) // 2]), ("image/png", bomb), ("image/png", png_bomb(20000, 20000)),
                   ("image/png", b""),
                   ("image/png", wav), ("image/webp", b"RIFF\x00\x00\x00\x00WEBPVP8 garbage"),
                   ("image/jpeg", b"\xff\xd8\xff" + rng.randbytes(300)), ("image/png", png[:40]),
                   ("audio/wav", png), ("video/mp4", png), ("image/png; charset=x", b"\x89PNG\r\n\x1a\n")]
    for i, (media_type, data) in enumerate(media_cases):
        post(f"keyframe {i} as {media_type}", *_multipart([_json_part(fl2va), _media_part("kf", media_type, data)]))
    ref2va = {"protocol": 2, "prompt": "<Picture 1> <Audio 2>", "ref_images": [{"part": "img"}],
              "ref_audios": [{"part": "snd"}]}
    riff = bytearray(wav)
    riff[24:28] = (10**9).to_bytes(4, "little")  # absurd sample rate
    long_wav = media.encode_wav_bytes(tone(40.0, 8000), 8000)
    for i, (media_type, data) in enumerate([("audio/wav", bytes(riff)), ("audio/wav", wav[:44]),
                                            ("audio/wav", b"RIFF\xff\xff\xff\xffWAVEfmt " + rng.randbytes(200)),
                                            ("audio/flac", b"fLaC" + rng.randbytes(300)), ("audio/wav", long_wav),
                                            ("audio/mpeg", png), ("audio/ogg", b"OggS" + rng.randbytes(100)),
                                            ("audio/wav", media.encode_wav_bytes(tone(0.5), 32000))]):
        post(f"audio {i}", *_multipart([_json_part(ref2va), _media_part("img", "image/png", png),
                                        _media_part("snd", media_type, data)]))
    video_ref = {"protocol": 2, "prompt": "<Video 1>", "ref_videos": [{"part": "vid"}]}
    for i, data in enumerate([b"\x00\x00\x00\x18ftypisom" + rng.randbytes(1000), b"\x00\x00\x00\x18ftypmp42",
                              b"\x1a\x45\xdf\xa3" + rng.randbytes(500)]):
        post(f"video {i}", *_multipart([_json_part(video_ref),
                                        _media_part("vid", "video/webm" if i == 2 else "video/mp4", data)]))
    return cases


def send_hostile(url: str, cases, headers: dict | None = None, strict: bool = True) -> tuple[list[str], dict[int, int]]:
    """Send every hostile case; (failures, count per status). A failure is no answer, a status outside 4xx, or a
    4xx without a JSON error code. `strict` (the aiohttp server) also asks for the error's message and for 400 on
    a bad Content-Length, which aiohttp's HTTP parser answers in plain text before the application runs."""
    failures, statuses = [], {}
    for label, method, path, case_headers, body in cases:
        try:
            status, _, data = remote_http.raw(url, method, path, body, {**case_headers, **(headers or {})}, timeout=20)
        except Exception as error:  # noqa: BLE001
            failures.append(f"{label}: no answer ({type(error).__name__}: {error})")
            continue
        statuses[status] = statuses.get(status, 0) + 1
        if not 400 <= status < 500:
            failures.append(f"{label}: {status} {data[:200]!r}")
        elif label.startswith("bad Content-Length"):
            if strict and status != 400:
                failures.append(f"{label}: {status}")
        else:
            try:
                error = json.loads(data)["error"]
                assert error["code"] and (not strict or error["message"])
            except Exception:  # noqa: BLE001
                failures.append(f"{label}: {status} without a JSON error body: {data[:120]!r}")
    return failures, statuses
