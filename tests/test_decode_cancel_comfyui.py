"""Cancel during MiniMax H3 VAE Decode's audio pass, in a real ComfyUI (UX issue 38 item 8): the node says at once
that the cancel arrived, and the audio decoder stops at its next layer instead of finishing the pass.

The graph decodes the zero latent of a text-only conditioning (H3SplitEmptyLatentFromConditioning: no DiT, no
sampling), so the run reaches the audio decode quickly. The interrupt is sent when the node's progress bar starts the
audio phase (its one-unit bar after the video tiles); that the pass stopped inside the decoder, at a layer, is read
from the exception ComfyUI's console shows (h3_core.diffusion.AudioCancel's message names the layer count). Counting
is in tests/test_audio_decode_cancel.py; nothing here is timed.
"""

from __future__ import annotations

import re
import struct
import time

from support.comfy_harness import comfy  # noqa: F401  (session fixture)
from support.comfy_pack import server  # noqa: F401  (module fixture: the session's ComfyUI with the tiny H3)

TINY = "[embedded] tiny H3 (noise)"
TEXT_FRAME = 3  # ComfyUI's binary websocket event type for a node's progress text (server.send_progress_text)


def graph(prompt: str) -> dict:
    return {
        "1": {"class_type": "H3SplitTextEncoderLoader", "inputs": {"text_encoder": TINY}},
        "2": {"class_type": "H3SplitVideoVAELoader", "inputs": {"vae": TINY}},
        "3": {"class_type": "H3SplitAudioVAELoader", "inputs": {"audio_vae": TINY}},
        "5": {"class_type": "H3SplitTextEncode", "inputs": {"text_encoder": ["1", 0], "prompt": prompt, "width": 0,
                                                            "height": 0, "length": 124, "task": "t2va"}},
        "6": {"class_type": "H3SplitEmptyLatentFromConditioning", "inputs": {"conditioning": ["5", 0]}},
        "7": {"class_type": "H3SplitDecode", "inputs": {"latent": ["6", 0], "vae": ["2", 0], "audio_vae": ["3", 0]}},
        "8": {"class_type": "SaveVideo", "inputs": {"video": ["7", 0], "filename_prefix": "h3cancel/decode",
                                                    "format": "mp4", "codec": "h264"}},
    }


def node_texts(result, node: str) -> list[str]:
    texts = []
    for frame in result.binary:
        if struct.unpack(">I", frame[:4])[0] != TEXT_FRAME:
            continue
        (length,) = struct.unpack(">I", frame[4:8])
        if frame[8:8 + length].decode() == node:
            texts.append(frame[8 + length:].decode())
    return texts


def test_cancel_during_the_audio_decode_is_acknowledged_and_stops_it_at_a_layer(server):  # noqa: F811
    seen = {"tiles": False}

    def on_message(message):
        data = message.get("data", {})
        if message.get("type") != "progress" or data.get("node") != "7":
            return
        if data.get("max", 0) > 1:
            seen["tiles"] = True  # the video tiles' bar
        elif seen["tiles"] and data.get("max") == 1 and data.get("value") == 0 and "sent" not in seen:
            seen["sent"] = True  # the audio decode's bar has started: cancel now
            server.interrupt()

    result = server.run_prompt(graph(f"Cancel the soundtrack {time.time()}."), timeout=600, check=False,
                               on_message=on_message)
    assert result.status == "interrupted", (result.status, result.error)
    assert seen.get("sent"), "the audio decode never started"
    texts = node_texts(result, "7")
    assert any(line == "cancelling after the current layer" or line.startswith("cancelled: decoding audio")
               for line in texts), texts
    stopped = re.findall(r"cancelled in the audio decode \(after (\d+) of its layers\)", server.log_text())
    assert stopped, server.log_tail()
    print(f"\n[decode cancel] Decode's text: {texts[-3:]}; the audio decoder stopped after {stopped[-1]} layers")
