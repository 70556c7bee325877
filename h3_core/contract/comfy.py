"""ComfyUI core's H3 CONDITIONING, to and from `H3Conditioning` (lossless both ways for what the contract holds).

Core's CONDITIONING is plain Python lists, dicts and tensors, so it is built and read here without importing
ComfyUI. Core's condition latents are the same *normalised* VAE latents the contract holds: core's video VAE
`encode` returns the posterior mean already normalised per channel and its audio VAE `encode` returns
normalised `[B, 32, 2, T]` latents, and `model_base.MiniMaxH3.extra_conds` passes them to the DiT untouched.
So the conversion is a re-arrangement, never arithmetic (values differ only in how they were produced: core
takes the video posterior mean, diffusers and vLLM sample it under the fixed keyframe seed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from .. import facts
from .errors import check_tensor, fail, is_int, shape
from .layout import audio_latent_to_rows, audio_rows_to_latent
from .wire import FORMAT_ID, FORMAT_VERSION, identity_fields

COMFY_PACK_KEY = "minimax_h3_pack"  # our extra key in the cond dict; core's extra_conds never reads it
# Core's ConditioningAverage and ConditioningZeroOut transform `pooled_output` exactly as they transform the prompt
# and core's H3 model never reads it (MiniMaxH3 has no ADM input), so the pack keeps there a signature of the
# condition media: the only value of `conditioning_from` that survives an average (`comfy_edits.py`).
MEDIA_SIGNATURE_KEY = "pooled_output"
CORE_REF_KINDS = ("image", "video", "video_audio", "audio")
_UNREPRESENTABLE_KEYS = ("minimax_visual_cond_noise_aug", "minimax_audio_cond_noise_aug")


def _f32(value: Any, name: str) -> torch.Tensor:
    """A tensor, half-precision upcast to float32 (exact): core may hold fp16/bf16 condition latents."""
    value = check_tensor(name, value)
    return value.to(torch.float32) if value.dtype in (torch.float16, torch.bfloat16) else value


def encode(cond) -> list:
    """ComfyUI core's H3 CONDITIONING: `[[prompt_embeds, extras]]`.

    Mapping (core form as Comfy-Org/ComfyUI:comfy_extras/nodes_minimax_h3.py builds it and
    comfy/model_base.py `MiniMaxH3.extra_conds` + comfy/ldm/minimax/model.py `PackedLayout` read it):

    * `cross_attn` (list item 0)          <- prompt_embeds `[1, L, D]`, dtype kept
    * `extras["minimax_token_tags"]`      <- text_token_tags int64 `[L]`
    * fl2va: `extras["minimax_keyframes"]` = one dict per keyframe, in order:
      `{"resolved_frame_index": 0 ('first') | num_frames - 1 ('last'), "latent": [1, C, 1, H/16, W/16]}`
      (core's MiniMaxH3ImageToVideo uses frame_count - 1 for the last frame)
    * ref2va: `extras["minimax_refs"]` = one dict per reference, in packed order:
      image: `{"kind": "image", "picture_index": i (ordinal among images), "latent_h", "latent_w", "latent"}`;
      video: `{"kind": "video_audio" if has_audio else "video", "latent_t", "latent_h", "latent_w",
      "ref_audio_t" (0 without audio), "latent", "audio_latent" ([1, 32, 2, T] or None)}`;
      audio: `{"kind": "audio", "ref_audio_t", "audio_latent" [1, 32, 2, T]}`.
      Audio rows `[2T, 32]` become core's `[1, 32, 2, T]` (channel-major unpack). Latents are the same
      normalised values core's VAEs produce, so no statistics are involved.
    * `extras["minimax_h3_pack"]` = `{"format", "version", "task", "height", "width", "num_frames",
      "metadata"}`: what core does not carry. Core's extra_conds never reads it.
    * `extras["pooled_output"]` = `media_signature(cond)` `[1, 16]`: lets the Sampler see that core's
      ConditioningAverage mixed in a conditioning made from other media (`comfy_edits.py`). Core's H3 model has
      no pooled input, and core's own H3 nodes leave it None.

    Tensors are shared, not copied (except the audio latents, which change layout).
    """
    extras: dict[str, Any] = {"minimax_token_tags": cond.text_token_tags}
    if cond.task == "fl2va":
        extras["minimax_keyframes"] = [
            {"resolved_frame_index": 0 if anchor == "first" else cond.num_frames - 1, "latent": lat}
            for anchor, lat in zip(cond.keyframe_anchors, cond.condition_latents, strict=False)
        ] + _guide_entries(cond)
    elif cond.task == "ref2va":
        refs = []
        visual = iter(cond.condition_latents)
        audio = iter(cond.audio_condition_latents)
        picture_index = 0
        for ref in cond.references:
            if ref.kind == "image":
                lat = next(visual)
                refs.append({"kind": "image", "picture_index": picture_index, "latent_h": int(lat.shape[3]),
                             "latent_w": int(lat.shape[4]), "latent": lat})
                picture_index += 1
            elif ref.kind == "video":
                lat = next(visual)
                audio_latent = audio_rows_to_latent(next(audio)) if ref.has_audio else None
                refs.append({"kind": "video_audio" if ref.has_audio else "video",
                             "latent_t": int(lat.shape[2]), "latent_h": int(lat.shape[3]),
                             "latent_w": int(lat.shape[4]),
                             "ref_audio_t": int(audio_latent.shape[-1]) if audio_latent is not None else 0,
                             "latent": lat, "audio_latent": audio_latent})
            else:
                audio_latent = audio_rows_to_latent(next(audio))
                refs.append({"kind": "audio", "ref_audio_t": int(audio_latent.shape[-1]),
                             "audio_latent": audio_latent})
        extras["minimax_refs"] = refs
    extras[COMFY_PACK_KEY] = {**identity_fields(cond), "metadata": dict(cond.metadata)}
    extras[MEDIA_SIGNATURE_KEY] = media_signature(cond)
    return [[cond.prompt_embeds, extras]]


def _guide_entries(cond) -> list[dict]:
    """Core's AddGuide entries for the conditioning's guides: `resolved_frame_index`, and `latent` / `audio_latent`
    where the guide has them (core's node leaves a key out rather than setting it None)."""
    video = iter(cond.condition_latents[len(cond.keyframe_anchors):])
    audio = iter(cond.audio_condition_latents)
    entries = []
    for guide in cond.guides:
        entry: dict[str, Any] = {"resolved_frame_index": guide.frame}
        if guide.video:
            entry["latent"] = next(video)
        if guide.audio:
            entry["audio_latent"] = audio_rows_to_latent(next(audio))
        entries.append(entry)
    return entries


def media_signature(cond) -> torch.Tensor:
    """`[1, 16]` float32 in 1..256: the xxh3-128 of what the conditioning's media made (condition latents, audio
    rows, keyframe anchors, reference kinds), one value per digest byte, never 0. Two conditionings encoded from
    the same media have the same signature; a weighted average of two different ones is no multiple of either."""
    hasher = xxhash.xxh3_128()
    hasher.update(repr((cond.keyframe_anchors, [(r.kind, r.has_audio) for r in cond.references])).encode())
    if cond.guides:  # added only when there are guides: a signature made before guides existed stays the same
        hasher.update(repr([(g.frame, g.video, g.audio) for g in cond.guides]).encode())
    for tensor in (*cond.condition_latents, *cond.audio_condition_latents):
        hasher.update(repr((str(tensor.dtype), tuple(tensor.shape))).encode())
        hasher.update(memoryview(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()))
    return torch.tensor([list(hasher.digest())], dtype=torch.float32) + 1.0


def decode(cls, conditioning: Sequence, *, task: str | None = None, height: int | None = None,
           width: int | None = None, num_frames: int | None = None, metadata: Mapping[str, str] | None = None):
    """Read ComfyUI core's H3 CONDITIONING (the inverse of `to_comfy`, mapping documented there).

    `task`/`height`/`width`/`num_frames`/`metadata` come from the `minimax_h3_pack` key when present;
    a CONDITIONING made by core's own nodes has none, so pass the canvas (e.g. from the LATENT) and the
    frame count explicitly; `task` is then inferred (refs -> ref2va, keyframes -> fl2va, else t2va).
    An explicit value that disagrees with the pack key is an error. Core features the contract cannot
    express raise `ContractError`: keyframes or guides mixed with refs, and the `minimax_*_cond_noise_aug`
    overrides. MiniMaxH3AddGuide's entries (any frame, clips, audio) are guides (`_keyframes`). `picture_index` is not
    read (core never consumes it). fp16/bf16 condition latents are upcast to fp32 (exact).
    """
    # Each reader raises on the first thing it refuses, and they run in this order: the order (and so which error
    # a payload with several faults gets) is part of the behaviour the tests pin.
    cross_attn, extras = _entry(conditioning)
    _check_representable(extras)
    pack = _pack(extras)
    keyframes, refs = _keyframes_and_refs(extras)
    task = _task(pack, task, keyframes, refs)
    height, width, num_frames = _canvas_and_frames(pack, height, width, num_frames)
    metadata = _resolve(pack, "metadata", None if metadata is None else dict(metadata))
    anchors, keyframe_latents, guides, guide_latents, guide_rows = _keyframes(keyframes, num_frames)
    ref_latents, audio_rows, references = _references(refs)
    return cls(
        task=task,
        height=height,
        width=width,
        num_frames=num_frames,
        prompt_embeds=check_tensor("cross_attn", cross_attn),
        text_token_tags=check_tensor("minimax_token_tags", extras["minimax_token_tags"]),
        # keyframes and references never come together (`_keyframes_and_refs`): one of the two is empty
        condition_latents=tuple(keyframe_latents + guide_latents + ref_latents),
        audio_condition_latents=tuple(guide_rows + audio_rows),
        keyframe_anchors=tuple(anchors),
        references=tuple(references),
        metadata=metadata or {},
        guides=tuple(guides),
    )


def _entry(conditioning: Any) -> tuple[Any, Mapping]:
    """The one `[cross_attn, extras]` entry: H3 runs batch 1, so a CONDITIONING of several entries is refused."""
    if not isinstance(conditioning, (list, tuple)) or len(conditioning) != 1:
        n = len(conditioning) if isinstance(conditioning, (list, tuple)) else type(conditioning).__name__
        raise fail("conditioning", f"must be a list of exactly one [cross_attn, extras] entry (H3 runs batch "
                                    f"1), got {n}")
    entry = conditioning[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], Mapping):
        raise fail("conditioning", "entry must be [cross_attn tensor, extras dict]")
    cross_attn, extras = entry
    return cross_attn, extras


def _check_representable(extras: Mapping) -> None:
    """Refuse a CONDITIONING no H3 text encoder made, and core's noise overrides the contract has no field for."""
    if "minimax_token_tags" not in extras:
        raise fail("minimax_token_tags", "missing: the CONDITIONING was not made by the MiniMax H3 text encoder")
    for key in _UNREPRESENTABLE_KEYS:
        if extras.get(key) is not None:
            raise fail(key, "condition noise overrides are not representable in H3Conditioning")


def _pack(extras: Mapping) -> Mapping:
    """The pack's own key (task, canvas, frames, metadata), checked; empty for a CONDITIONING core's nodes made."""
    pack = extras.get(COMFY_PACK_KEY)
    if pack is not None:
        if not isinstance(pack, Mapping) or pack.get("format") != FORMAT_ID:
            raise fail(COMFY_PACK_KEY, f"must be a mapping with format {FORMAT_ID!r}")
        if pack.get("version") != FORMAT_VERSION:
            raise fail(COMFY_PACK_KEY, f"unsupported version {pack.get('version')!r}")
    return pack or {}


def _resolve(pack: Mapping, name: str, explicit: Any) -> Any:
    """The explicit value, else the pack's; both given and different is an error (neither silently wins)."""
    packed = pack.get(name)
    if packed is not None and not isinstance(packed, (str, int, float, Mapping)):
        # a hostile pack key could hold a tensor, whose `!=` is no bool: refuse it by name instead
        raise fail(name, f"{COMFY_PACK_KEY}[{name!r}] must be a plain value, got {type(packed).__name__}")
    if explicit is not None and packed is not None and explicit != packed:
        raise fail(name, f"explicit value {explicit!r} conflicts with {COMFY_PACK_KEY}[{name!r}]={packed!r}")
    return explicit if explicit is not None else packed


def _keyframes_and_refs(extras: Mapping) -> tuple[Any, Any]:
    """Core's keyframe and reference lists; a conditioning holds one task, so never both."""
    keyframes, refs = _listed(extras, "minimax_keyframes"), _listed(extras, "minimax_refs")
    if keyframes and refs:
        raise fail("minimax_keyframes", "keyframes together with references are not representable (one task "
                                         "per conditioning)")
    return keyframes, refs


def _listed(extras: Mapping, key: str) -> list | tuple:
    """Core's list under `key` (absent or None: empty); anything else (a tensor, a dict) is refused by name."""
    value = extras.get(key)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise fail(key, f"must be a list of dicts, got {type(value).__name__}")
    return value


def _task(pack: Mapping, task: Any, keyframes: Any, refs: Any) -> Any:
    """The explicit or packed task; without either (core's own nodes), inferred: references, keyframes or text only."""
    task = _resolve(pack, "task", task)
    if task is None:
        task = "ref2va" if refs else "fl2va" if keyframes else "t2va"
    return task


def _canvas_and_frames(pack: Mapping, height: Any, width: Any, num_frames: Any) -> tuple[Any, Any, Any]:
    """Height, width and frame count: core's CONDITIONING carries none of them, so the pack key or the caller must."""
    height, width, num_frames = (_resolve(pack, "height", height), _resolve(pack, "width", width),
                                 _resolve(pack, "num_frames", num_frames))
    for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
        if value is None:
            raise fail(name, f"not carried by core's CONDITIONING and no {COMFY_PACK_KEY} key: pass it "
                              f"explicitly (e.g. from the LATENT)")
    return height, width, num_frames


def _keyframes(keyframes: Any, num_frames: Any):
    """Core's `minimax_keyframes`, in order. An entry that is one image at frame 0 or num_frames - 1 (what
    MiniMaxH3ImageToVideo makes) is a keyframe anchor ('first' / 'last', diffusers' layout, once each); any other
    (MiniMaxH3AddGuide's: any frame, a clip, an audio) is a guide. The row order of the two kinds differs from core's
    list order where they interleave, which changes nothing a forward computes: every row carries its own position.
    Returns (anchors, their latents, guides, the guides' video latents, the guides' audio rows)."""
    if len(keyframes) > facts.MAX_KEYFRAMES + facts.MAX_GUIDES:
        raise fail("minimax_keyframes", f"holds {len(keyframes)} entries, over the {facts.MAX_KEYFRAMES} keyframes "
                                        f"and {facts.MAX_GUIDES} guides a conditioning may carry")
    anchors, latents, guides, guide_latents, guide_rows = [], [], [], [], []
    for i, kf in enumerate(keyframes):
        name = f"minimax_keyframes[{i}]"
        if not isinstance(kf, Mapping):
            raise fail(name, "must be a dict")
        index = kf.get("resolved_frame_index")
        if not is_int(index):
            raise fail(name, f"resolved_frame_index must be an int, got {type(index).__name__}")
        latent = None if kf.get("latent") is None else _f32(kf["latent"], f"{name}['latent']")
        audio = None if kf.get("audio_latent") is None else _f32(kf["audio_latent"], f"{name}['audio_latent']")
        if latent is None and audio is None:
            raise fail(name, "has neither a video latent nor an audio latent")
        anchor = _anchor(index, num_frames) if audio is None and latent.ndim == 5 and latent.shape[2] == 1 else None
        if anchor is not None and anchor not in anchors:
            anchors.append(anchor)
            latents.append(latent)
            continue
        guides.append((index, latent is not None, audio is not None))  # H3Guide.coerce's triple
        if latent is not None:
            guide_latents.append(latent)
        if audio is not None:
            if audio.ndim != 4:
                raise fail(f"{name}['audio_latent']", f"must be [1, 32, 2, T], got {shape(audio)}")
            guide_rows.append(audio_latent_to_rows(audio))
    if anchors == ["last", "first"]:  # diffusers' anchor sets list the first frame first
        anchors.reverse()
        latents.reverse()
    return anchors, latents, guides, guide_latents, guide_rows


def _anchor(index: int, num_frames: Any) -> str | None:
    """'first' for frame 0, 'last' for frame num_frames - 1 (diffusers' two anchors), else None (a guide)."""
    if index == 0:
        return "first"
    if is_int(num_frames) and index == num_frames - 1:
        return "last"
    return None


def _references(refs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[str, bool]]]:
    """Core's `minimax_refs`, in packed order: visual latents, audio rows, and (kind, has_audio) per reference."""
    latents, audio_rows, references = [], [], []
    for i, ref in enumerate(refs):
        name = f"minimax_refs[{i}]"
        if not isinstance(ref, Mapping):
            raise fail(name, "must be a dict")
        kind = ref.get("kind")
        if kind not in CORE_REF_KINDS:
            raise fail(name, f"kind must be image/video/video_audio/audio, got {kind!r}")
        if kind != "audio":
            latents.append(_ref_latent(ref, kind, name))
        rows = _ref_audio_rows(ref, kind, name)
        if rows is not None:
            audio_rows.append(rows)
        references.append(("video" if kind == "video_audio" else kind, rows is not None))
    return latents, audio_rows, references


def _ref_latent(ref: Mapping, kind: str, name: str) -> torch.Tensor:
    """A visual reference's latent [1, C, T, h, w], its declared latent_h/latent_w (and latent_t) checked against it."""
    lat = _f32(ref.get("latent"), f"{name}['latent']")
    if lat.ndim != 5:
        raise fail(f"{name}['latent']", f"must be [1, C, T, h, w], got {shape(lat)}")
    declared = [("latent_h", 3), ("latent_w", 4)] + ([("latent_t", 2)] if kind != "image" else [])
    for key, dim in declared:
        if not is_int(ref.get(key)) or ref.get(key) != lat.shape[dim]:
            raise fail(name, f"{key}={ref.get(key)!r} does not match the latent shape {shape(lat)}")
    return lat


def _ref_audio_rows(ref: Mapping, kind: str, name: str) -> torch.Tensor | None:
    """A reference's audio latent [1, 32, 2, T] as the contract's rows [2T, 32], T checked against ref_audio_t;
    None for the kinds without audio, which must then carry none."""
    audio_latent = ref.get("audio_latent")
    ref_audio_t = ref.get("ref_audio_t", 0)
    if ref_audio_t is None:
        ref_audio_t = 0
    if not is_int(ref_audio_t):
        raise fail(name, f"ref_audio_t must be an int, got {type(ref_audio_t).__name__}")
    if kind not in ("video_audio", "audio"):
        if audio_latent is not None or ref_audio_t:
            raise fail(name, f"kind {kind!r} must carry no audio (audio_latent None, ref_audio_t 0)")
        return None
    audio_latent = _f32(audio_latent, f"{name}['audio_latent']")
    if audio_latent.ndim != 4 or audio_latent.shape[-1] != ref_audio_t:
        raise fail(name, f"ref_audio_t={ref_audio_t!r} does not match audio_latent "
                          f"{shape(audio_latent)}")
    return audio_latent_to_rows(audio_latent)
