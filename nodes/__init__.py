"""Thin ComfyUI V3 adapters over h3_core: ComfyUI types in, h3_core calls, ComfyUI types out.

    loaders.py          Load MiniMax H3 Text Encoder / Video VAE / Audio VAE / DiT
    media.py            MiniMax H3 Keyframes, MiniMax H3 References (the order the prompt's tags use)
    guides.py           MiniMax H3 Guide (any frame), MiniMax H3 Continue Video (guides in the media bundle)
    encode.py           MiniMax H3 Text Encode -> MiniMax H3 Video VAE Encode -> MiniMax H3 Audio VAE Encode
    remote.py           MiniMax H3 Remote Encode (the same conditioning from an encoder endpoint)
    encode_ahead.py     the next queued prompt's remote encodes started while the current prompt runs
    sample.py           MiniMax H3 Sampler
    decode.py           MiniMax H3 VAE Decode
    conditioning_io.py  H3 Save / Load Conditioning
    core_latent.py      MiniMax H3 Empty Latent from Conditioning (the pack's conditioning into core's own H3 sampler)
    comfy_bridge.py     the one module touching ComfyUI internals (model management, progress, types)
    comfy_queue_seam.py the queue / executor internals encode-ahead reads, feature-detected (off when missing)
    low_vram.py         DiT / text-encoder layers streamed by ComfyUI's low-VRAM loading (cast-weights protocol)
    memory.py           what each node asks ComfyUI to keep free (the planner's activation estimate)
    input_checks.py     queue-time checks, reported one `input: message` line per problem
    validation_errors.py  POST /prompt: one error per problem, on the input it names (not one per input)
    error_names.py      the pack's exception types named without a file-system path in ComfyUI's reports

Node ids start with `H3Split` and never change; new widgets are appended, never inserted.
"""

from comfy_api.latest import ComfyExtension, io

from . import (
    conditioning_io,
    core_latent,
    decode,
    encode,
    error_names,
    guides,
    loaders,
    media,
    sample,
    validation_errors,
)

NODE_MODULES = [loaders, media, guides, encode, sample, decode, conditioning_io, core_latent]
try:  # the remote node needs only h3_core.remote; keep the pack usable if it fails to import
    from . import encode_ahead, remote

    NODE_MODULES.append(remote)
except ImportError as error:  # pragma: no cover - reported in the ComfyUI log
    encode_ahead = None
    print(f"[MiniMax H3 split] remote encode node unavailable: {error}")


def install_example_inputs() -> None:
    """Copy the shipped workflows' example media into ComfyUI's input/ (never overwriting), so the
    templates in example_workflows/ run as soon as they are opened or dropped onto the canvas."""
    import shutil
    from pathlib import Path

    import folder_paths

    source = Path(__file__).resolve().parent.parent / "workflows" / "inputs"
    target = Path(folder_paths.get_input_directory())
    if not source.is_dir():
        return
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.glob("h3_example_*")):
        if not (target / item.name).exists():
            shutil.copyfile(item, target / item.name)


class H3Extension(ComfyExtension):
    async def on_load(self) -> None:
        install_example_inputs()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        install_example_inputs()  # cores that predate on_load (e.g. 0.3.75) only call this
        if encode_ahead is not None:
            encode_ahead.install(remote.AHEAD)  # the on-prompt hook (idempotent)
        validation_errors.install()  # one validation error per problem (idempotent)
        error_names.rename(__name__.rpartition(".")[0])  # the pack's exception types without a path in reports
        return [node for module in NODE_MODULES for node in module.NODES]
