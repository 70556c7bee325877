"""`python -m h3_core ...`: the headless path without ComfyUI.

    tiny      build the embedded tiny H3 (diffusers root + ComfyUI single files + native partitions)
    encode    stage 0: prompt + media -> conditioning (.safetensors), locally or via --server
    generate  stage 1: conditioning -> mp4 (H.264 + AAC, 24 fps, 32 kHz stereo)
    check     which component/layout a file or folder is, and whether it maps with zero missing/unexpected keys
    serve     the disaggregated encoder endpoint

Progress goes to stderr; errors exit non-zero with one clear line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import comfy_run, component_args, devices, facts, loadbar, progress
from .planning import report as plan_report
from .remote.engines import options as engines


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(label: str):
    def report(done: int, total: int) -> None:
        _log(f"{label}: step {done}/{total}")

    return report


def _phase_printer():
    """The CLI's `progress.reporting` sink: one stderr line per phase start, end and tenth in between."""
    from .progress import PHASES

    last = {}

    def sink(phase: str, done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if done not in (0, total) and last.get(phase) == tenth:
            return
        last[phase] = tenth
        if PHASES[phase] == "bytes":
            _log(f"{phase}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({done * 100 // max(total, 1)}%)")
        else:
            _log(f"{phase}: {PHASES[phase].rstrip('s')} {done}/{total}")

    return sink


def _cmd_tiny(args) -> int:
    from . import tiny

    start = time.perf_counter()
    if args.twins == "gguf" and (Path(args.out) / "tiny.json").is_file():
        out = Path(args.out)  # an existing build: add the GGUF twins only
    else:
        out = tiny.build(args.out, seed=args.seed)
        _log(f"built the tiny H3 (seed {args.seed}) in {time.perf_counter() - start:.1f} s")
    if args.twins == "gguf":
        from .tiny import gguf_twins as tiny_gguf

        written = tiny_gguf.write_gguf_twins(out / "comfyui")
        _log(f"wrote {len(written)} GGUF twins in {time.perf_counter() - start:.1f} s")
    print(out)
    return 0


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_AUDIO_SUFFIXES = (".wav", ".mp3", ".flac", ".ogg", ".m4a", ".aac", ".opus")


def _guide(spec: str):
    """`--guide FRAME:PATH[:video|:audio]`: an image, a clip (with its soundtrack) or an audio at output frame FRAME
    (negative from the end); `:video` / `:audio` keeps only that part of a clip."""
    from . import guides, media

    frame, sep, path = spec.partition(":")
    keep = "both"
    if path.endswith((":video", ":audio")):
        path, keep = path.rsplit(":", 1)
    try:
        index = int(frame)
    except ValueError:
        index = None
    if not sep or not path or index is None:
        raise ValueError(f"--guide takes FRAME:PATH[:video|:audio] (e.g. 60:still.png, -1:end.png, 0:clip.mp4), got "
                         f"{spec!r}")
    suffix = Path(path).suffix.lower()
    if suffix in _IMAGE_SUFFIXES:
        return guides.GuideMedia(index, frames=media.read_image(path)[None])
    if suffix in _AUDIO_SUFFIXES:
        waveform, rate = media.read_audio(path, max_seconds=facts.MAX_AUDIO_CLIP_S + 1)
        return guides.GuideMedia(index, audio=waveform, sample_rate=rate)
    clip = media.read_video(path, max_frames=guides.MAX_GUIDE_FRAMES, truncate=True, fps=None)
    keep_audio = keep != "video" and clip.audio is not None
    return guides.GuideMedia(index, frames=None if keep == "audio" else clip.frames,
                             audio=clip.audio if keep_audio else None, sample_rate=clip.sample_rate if keep_audio
                             else None)


def _continuation(path: str, overlap: int):
    """`--continue CLIP`: the clip's last --overlap frames and their soundtrack, anchored at frame 0."""
    from . import guides, media

    clip = media.read_video(path)
    return guides.continuation(clip.frames, clip.fps, clip.audio, clip.sample_rate, overlap)


def _build_request(args):
    from .request import EncodeRequest

    request = EncodeRequest.from_sources(
        args.prompt,
        task=args.task,
        width=args.width,
        height=args.height,
        num_frames=args.frames,
        first_frame=args.first_frame or None,
        last_frame=args.last_frame or None,
        ref_images=args.ref_image,
        ref_videos=args.ref_video,
        ref_audios=args.ref_audio,
    )
    request.guides = ([_continuation(args.continue_clip, args.overlap)] if args.continue_clip else []) + \
        [_guide(spec) for spec in args.guide]
    return request


def _cmd_encode(args) -> int:
    request = _build_request(args)
    start = time.perf_counter()
    if args.server:
        from .remote.client import credentials
        from .remote.client.encoder_client import EncoderClient

        # The token goes only where the environment binds it (H3_ENCODER_URLS / H3_ENCODER_TOKENS); "" (not None)
        # keeps the client from reading H3_ENCODER_TOKEN behind the policy's back.
        token = credentials.token_for(args.server) or ""
        cond = EncoderClient(args.server, token=token, read_timeout=args.timeout).encode(request)
    else:
        from .encoder import EncoderStage

        request.validate()  # cheap rules before loading any weights
        with progress.reporting(loadbar.wrap(_phase_printer())):
            stage = EncoderStage(component_args.model_source(args), **devices.stage_kwargs(args, "text_encoder"))
            cond = stage.encode(request)
    cond.save(args.out)
    _log(
        f"encoded {cond.task} ({cond.width}x{cond.height}, {cond.num_frames} frames, "
        f"{cond.prompt_embeds.shape[1]} tokens) in {time.perf_counter() - start:.2f} s"
    )
    print(args.out)
    return 0


def _wants_image(args) -> bool:
    """`generate --image`, or an --out ending in .png: write the first frame as a PNG (text to image)."""
    return bool(getattr(args, "image", False)) or str(args.out).lower().endswith(".png")


def _cmd_generate(args) -> int:
    if _wants_image(args) and args.dump:
        raise ValueError("--dump writes the whole video and its audio; leave it out with --image (a PNG)")
    if args.sp != 1:
        from . import step_cache

        step_cache.parse(args.cache)  # a bad --cache is refused here, not by each rank after the ranks started
        _generate_parallel(args)
    else:
        _generate(args)
    print(args.out)
    return 0


def _generate(args, pool=None) -> None:
    """Sample, decode and write; with a sequence-parallel worker `pool` (`generate --sp N`) the DiT samples on its
    ranks (which load the LoRAs from their files) and this process decodes and writes."""
    from . import media
    from .contract import H3Conditioning
    from .diffusion import DiffusionStage, SamplingOptions
    from .lora import parse_spec, stack_for_run

    cond = H3Conditioning.load(args.cond)
    stage = DiffusionStage(component_args.model_source(args, cond.task), **devices.stage_kwargs(args, "transformer"))
    start = time.perf_counter()
    lora_files = [parse_spec(spec) for spec in args.lora or ()]
    options = SamplingOptions(
        steps=args.steps,
        seed=args.seed,
        video_shift=args.video_shift,
        audio_shift=args.audio_shift,
        progress=_progress("denoise"),
        lora=None if pool is not None else stack_for_run(
            lora_files, steps=args.steps, video_shift=args.video_shift, audio_shift=args.audio_shift,
            audio=not args.lora_skip_audio, log=_log),
        lora_strength=args.lora_strength,
        cache=args.cache,
    )
    with progress.reporting(loadbar.wrap(_phase_printer())):
        if pool is None:
            latents = stage.sample(cond, options)
        else:  # the options cross to the ranks in one place (SamplingOptions.to_wire), the LoRAs as their files
            for path, strength in lora_files:
                _log(f"lora: {path} at strength {strength:g} (loaded by each rank)")
            latents = pool.sample(cond, options, lora_files, lora_audio=not args.lora_skip_audio)
            pool.close()  # the ranks' DiT copies go before this process decodes
        _log(f"cache: {latents.passes}")
        if _wants_image(args):  # text to image: the first frame, as a PNG
            stage.decode_to_png(latents, args.out)
        elif not args.dump:  # streamed: each decoded clip goes to the mp4 encoder, the video is never held whole
            stage.decode_to_mp4(latents, args.out)
        else:
            decoded = stage.decode(latents)
    if args.dump:
        media.write_mp4(args.out, decoded.video, decoded.audio, fps=decoded.fps, sample_rate=decoded.sample_rate)
        from safetensors.torch import save_file

        save_file(
            {
                "video": decoded.video.contiguous(),
                "audio": decoded.audio.contiguous(),
                "latents": latents.video.contiguous(),
                "audio_latents": latents.audio.contiguous(),
            },
            args.dump,
        )
    ranks = f" on {pool.layout.degree} sequence-parallel ranks" if pool is not None else ""
    _log(f"generated {cond.num_frames} frames in {time.perf_counter() - start:.2f} s{ranks}")


def _generate_parallel(args) -> None:
    """`generate --sp N`: check the request against the machine and the DiT, then sample on N ranks of the one
    sequence-parallel engine, the worker pool of the Sampler's `gpus` (sequence_parallel_workers.WorkerPool: ranks
    forked warm by one launcher, an authenticated loopback channel each); decode and write here."""
    from . import sequence_parallel, sequence_parallel_workers
    from .contract import H3Conditioning
    from .models import PARTITION_OF_TASK

    task = H3Conditioning.load(args.cond).task
    source = component_args.model_source(args, task)
    component = PARTITION_OF_TASK[task]
    dit = source.paths.get(component)
    heads = sequence_parallel.dit_heads(dit) if dit is not None else None
    layout = sequence_parallel.check(args.sp, args.sp_mode, devices.parse_device(args.device), heads)
    placement = devices.stage_kwargs(args, "transformer")
    recipe = sequence_parallel_workers.DiTRecipe.of(source, component, placement["dtype"],
                                                    offload=placement["offload"])
    _log(f"starting {layout.degree} sequence-parallel ranks ({layout.mode}, {layout.backend})")

    def started(stage: str, done: int, total: int) -> None:
        if done == total:
            _log(f"{total} ranks " + ("connected" if stage == "connect" else "ready"))

    pool = sequence_parallel_workers.WorkerPool(recipe, layout)
    try:
        pool.start(on_start=started)
        _generate(args, pool)
    finally:
        pool.close()


def _cmd_check(args) -> int:
    from .weights import check

    report = check(args.path)
    print(report if isinstance(report, str) else str(report))
    return 0 if getattr(report, "ok", True) else 1


def _cmd_serve(args) -> int:
    from .remote.engines.options import main as serve_main

    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h3_core", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny", help="build the embedded tiny H3 (random weights: outputs are noise)")
    tiny.add_argument("--out", required=True, help="folder to write")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--twins", choices=("gguf",),
                      help="also write the GGUF twins (into an existing build at --out, else after building it)")
    tiny.set_defaults(func=_cmd_tiny)

    def models_args(p):
        p.add_argument("--models", help="tiny output, diffusers root, native partition or ComfyUI models/ folder")
        p.add_argument("--layout", choices=("diffusers", "comfyui", "native"), help="inside a tiny output folder")

    encode = sub.add_parser("encode", help="stage 0: prompt + media -> conditioning safetensors")
    models_args(encode)
    component_args.add_component_args(encode)
    devices.add_arguments(encode)
    encode.add_argument("--out", required=True, help="conditioning file to write (.safetensors)")
    encode.add_argument("--prompt", required=True)
    encode.add_argument("--task", choices=("t2va", "fl2va", "ref2va"), help="default: inferred from the media")
    encode.add_argument("--width", type=int, help="px, multiple of 32 (default: H3's canvas rule)")
    encode.add_argument("--height", type=int, help="px, multiple of 32")
    encode.add_argument(
        "--frames",
        type=int,
        default=facts.DEFAULT_FRAMES,
        help=f"17k+5 frames at {facts.FPS} fps, {facts.MIN_FRAMES}..{facts.MAX_FRAMES}; H3 was trained on "
        f"{facts.TRAINED_MIN_FRAMES}..{facts.TRAINED_MAX_FRAMES} (outside: a warning) (default %(default)s)",
    )
    encode.add_argument("--first-frame", help="image the video starts from (fl2va)")
    encode.add_argument("--last-frame", help="image the video ends on (fl2va)")
    encode.add_argument("--ref-image", action="append", default=[], help="reference image (ref2va, <= 9)")
    encode.add_argument("--ref-video", action="append", default=[], help="reference video, soundtrack kept (<= 3)")
    encode.add_argument("--ref-audio", action="append", default=[], help="reference audio (<= 3)")
    encode.add_argument("--guide", action="append", default=[], metavar="FRAME:PATH[:video|:audio]",
                        help="anchor an image, a clip (with its soundtrack) or an audio at output frame FRAME "
                        "(negative: from the end), as core's Add Guide; repeatable (fl2va)")
    encode.add_argument("--continue", dest="continue_clip", metavar="CLIP",
                        help="continue a video: its last --overlap frames and their soundtrack start the new one")
    encode.add_argument("--overlap", type=int, default=22,
                        help="with --continue: frames of the clip the new video starts with, 17k+5 (default 22)")
    encode.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="with --server: seconds for the whole remote call, retries included (default 300)",
    )
    encode.add_argument(
        "--server",
        help="encode on a remote H3 encoder endpoint instead of locally "
        "(comma-separated URLs fail over; the token from H3_ENCODER_TOKEN goes only to the URLs "
        "listed in H3_ENCODER_URLS, docs/DEPLOY.md)",
    )
    encode.set_defaults(func=_cmd_encode)

    generate = sub.add_parser("generate", help="stage 1: conditioning -> mp4")
    models_args(generate)
    component_args.add_component_args(generate)
    devices.add_arguments(generate)
    generate.add_argument("--cond", required=True, help="conditioning file from `encode`")
    generate.add_argument("--out", required=True, help="mp4 to write (a PNG with --image, or when it ends in .png)")
    generate.add_argument("--image", action="store_true",
                          help="text to image: write the video's first frame to --out as a PNG, audio discarded "
                          f"(make the conditioning with `encode --frames {facts.IMAGE_FRAMES}`, the shortest clip, "
                          "as ComfyUI core's text to image does)")
    generate.add_argument("--seed", type=int, default=0, help="as diffusers' torch.Generator('cpu').manual_seed(S)")
    generate.add_argument("--steps", type=int, default=50, help="sigma points incl. the final 0 (default 50)")
    generate.add_argument("--video-shift", type=float, help="flow shift of the video stream (default 12)")
    generate.add_argument("--audio-shift", type=float, help="flow shift of the audio stream (default 3)")
    generate.add_argument(
        "--lora", action="append", metavar="FILE[:STRENGTH]",
        help="DiT LoRA (.safetensors) at STRENGTH (default 1); repeat to stack several. E.g. a Turbo or PDD LoRA "
        "with its own --steps/--video-shift. Musubi-tuner, DiffSynth-Studio, ai-toolkit, Comfy-Org and diffusers "
        "namings load; a tensor that cannot be placed is an error naming it",
    )
    generate.add_argument("--lora-strength", type=float, default=1.0,
                          help="multiplier on every --lora's strength (default 1)")
    generate.add_argument("--lora-skip-audio", action="store_true",
                          help="leave the LoRAs' audio-branch weights out (audio_proj_in/out, the AdaLN audio rows, "
                          "a PDD audio head bank): the audio stays the base model's as far as the LoRA can reach")
    generate.add_argument("--dump", help="also write video/audio/latents tensors to this .safetensors")
    generate.add_argument(
        "--sp", type=int, default=1,
        help="sequence-parallel ranks for the DiT (default 1): one process per GPU from --device cuda:K on "
        "(cuda:K..K+N-1), or N gloo processes on the CPU; the DiT's heads must divide by N",
    )
    generate.add_argument("--sp-mode", choices=("ulysses", "ring"), default="ulysses",
                          help="attention exchange between ranks (ring: CUDA only; default %(default)s)")
    generate.add_argument(
        "--cache", default="off",
        help="step caching of the DiT: off (default, exact), quality, balanced, fast (cache-dit's DBCache, "
        "pip install cache-dit), every:K (the block stack every K-th step), or dbcache:fn=1,bn=1,warmup=4,"
        "threshold=0.12,max_continuous=3,max_cached=-1,taylorseer=1 (docs/REAL_WEIGHTS.md, Step caching)",
    )
    generate.set_defaults(func=_cmd_generate)

    check = sub.add_parser("check", help="identify a weights file/folder and check its keys (headers only)")
    check.add_argument("path")
    check.set_defaults(func=_cmd_check)

    serve = sub.add_parser("serve", help="run the disaggregated encoder endpoint")
    models_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; any other needs a token)")
    serve.add_argument("--port", type=int, default=8190, help="TCP port (0: any free port, printed on stdout)")
    serve.add_argument("--token-env", default="H3_ENCODER_TOKEN", help="environment variable holding the bearer token")
    serve.add_argument(
        "--components",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=None,
        help="encoders to load, comma-separated subset of text,video,audio (default all)",
    )
    devices.add_arguments(serve, dtype_help="text encoder dtype (auto: float32 on CPU, bfloat16 on CUDA; VAEs follow "
                          "the official rule); match the local path for bit-identical results")
    serve.add_argument("--queue-size", type=int, help="requests waiting for or in the model (default 32)")
    serve.add_argument(
        "--deadline",
        type=float,
        help="per-request deadline in seconds, default and maximum a client may ask for (default 300)",
    )
    serve.add_argument(
        "--max-decoded-mb", type=float, help="decoded media per request in MiB, counted from the headers (default 3072)"
    )
    serve.add_argument("--max-body-mb", type=float, help="largest request body in MiB (default 512)")
    serve.add_argument("--cache-mb", type=float, help="conditioning cache size in MiB (default 512; 0 disables)")
    serve.add_argument("--decode-timeout", type=float,
                       help="seconds one media part may take to decode in the sandbox (default 120)")
    serve.add_argument("--decode-in-process", action="store_true",
                       help="decode media in the server process instead of the sandbox (debugging only: a decoder "
                       "crash then takes the server down)")
    engines.add_serve_arguments(serve)
    from .remote.server.config import add_cache_args, add_limit_args, add_scheduling_args

    add_scheduling_args(serve)
    add_cache_args(serve)
    add_limit_args(serve)
    serve.set_defaults(func=_cmd_serve)

    plan_report.add_parser(sub)
    comfy_run.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "models", "unset") is None and args.command in ("encode", "generate", "serve"):
        if not (args.command == "encode" and args.server) and not component_args.given(args):
            print("error: --models is required", file=sys.stderr)
            return 2
    # Bitwise reproducibility across processes needs a fixed thread count (docs/ARCHITECTURE.md §2.1, trap 5).
    if "H3_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["H3_THREADS"]))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as error:
        if os.environ.get("H3_DEBUG"):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
