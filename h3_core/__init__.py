"""h3_core: MiniMax H3 split into an encoder stage and a diffusion stage, joined by a contract.

No ComfyUI imports anywhere in this package: the CLI, the encoder server and the ComfyUI nodes
all call the same functions.

    facts.py        every H3 number (fps, sample rates, frame grid, limits, shifts), pinned against diffusers
    rules.py        request rules built on the facts (canvas, frames, task, reference counts and durations)
    media/          decode images/video/audio (base, audio, video), resample to 32 kHz stereo, write mp4 (mp4);
                    sandbox: decode untrusted media in a forked, memory-capped worker (a crash costs one request)
    request.py      EncodeRequest: decoded media + numbers, fixed reference order
    encoder.py      STAGE 0: EncoderStage (Qwen3-VL text, video VAE, audio VAE)  -> H3Conditioning
    contract/       THE CONTRACT: H3Conditioning, its validation, file/bytes, core and vLLM conversions
    diffusion.py    STAGE 1: DiffusionStage, SamplingOptions (DiT loop, decode)   <- H3Conditioning
    assembly.py     encoding in parts, node by node, bit-identical to the one-call stage
    models.py       ModelSource: which file holds which component (built on weights.scan)
    weights/        per-component handlers (keys, configs, formats), detection, loading, `check`
    remote/         THE WIRE: encoder server (service, http, ingest) and client (packing, transport)
    diffusers_adapter.py  the only imports of diffusers private helpers
    testing.py      synthetic media and the canonical requests shared by tests and benchmarks
    planning/       the header-only memory planner, the `plan` report and the published tables
    tiny/           the embedded tiny H3 and its twins in every published format (quantised, pruned, GGUF)

docs/ARCHITECTURE.md is the map.
"""

__version__ = "0.7.0"
