"""h3_core: MiniMax H3 split into an encoder stage and a diffusion stage, joined by a contract.

No ComfyUI imports anywhere in this package: the CLI, the encoder server and the ComfyUI nodes
all call the same functions.

    rules.py      request rules (17k+5 frames, 32-px canvas, durations, reference counts)
    media.py      av: decode images/video/audio, resample to 32 kHz stereo, write mp4
    request.py    EncodeRequest: decoded media + numbers, fixed reference order
    encoder.py    stage 0: EncoderStage (Qwen3-VL text, video VAE, audio VAE)  -> H3Conditioning
    contract.py   H3Conditioning: fields, validation, safetensors wire form, core/vLLM conversions
    diffusion.py  stage 1: DiffusionStage (DiT loop, decode)                    <- H3Conditioning
    models.py     ModelSource: which file holds which component, load only what a stage needs
    weights/      layout detection, key conversions, `check`
    tiny.py       the embedded tiny H3
"""

__version__ = "0.1.0"
