"""Loaders: one node per H3 component, reading ComfyUI's standard model folders.

Each accepts every layout h3_core loads: a Comfy-Org single file (diffusion_models/,
text_encoders/, vae/), a whole-model folder under models/minimax_h3/ (an official diffusers root or
a native partition), or the embedded tiny H3. The weights live under ComfyUI's model management; the DiT's and
the text encoder's layers stream through it when VRAM is short (low_vram.py).

Dtypes follow h3_core's one rule (`h3_core.dtypes.compute_dtype` for the machine's compute device: bf16 for the
DiT and text encoder on a GPU, float32 on a CPU-only machine, the official float32 video VAE, the float32-only audio
VAE); each loader's `weight_dtype` widget ("default" = that rule) overrides it. Reading a file drives the loader
node's progress bar.
"""

from __future__ import annotations

from dataclasses import dataclass

import comfy.model_management as mm
import torch
from comfy_api.latest import io

from ..h3_core import devices, dtypes
from ..h3_core.models import ModelSource
from . import comfy_bridge as bridge
from . import model_files, progress_text
from .input_checks import declared_problems, report
from .types import LOADERS_CATEGORY, AudioVAE, DiT, Schema, TextEncoder, VideoVAE


@dataclass
class LoadedModel:
    """What a loader hands downstream: the managed module(s) plus where they came from."""

    patcher: object  # ComfyUI ModelPatcher around the module
    source: ModelSource
    fingerprint: str
    extra: dict  # tokenizer/processor (text encoder), partition name (DiT)
    dtype: torch.dtype = torch.float32  # what the module computes in (the dtype rule or the weight_dtype widget)

    @property
    def module(self) -> torch.nn.Module:
        return bridge.unwrap(self.patcher)

    @property
    def pipeline_config(self) -> dict:
        return self.source.pipeline_config


def _source(folder: str, choice: str, component: str) -> ModelSource:
    path, whole_folder = bridge.resolve_model_path(folder, choice)
    if whole_folder:
        return ModelSource.from_path(path)
    return ModelSource.for_file(component, path)


def _weight_dtype_input(options: list[str], what: str):
    return io.Combo.Input(
        "weight_dtype",
        options=options,
        default="default",
        optional=True,
        tooltip=f"Dtype the {what} is loaded and runs in. default: bf16 on a GPU, fp32 on CPU (the pack's one rule; "
        "the video VAE stays fp32 and decodes under fp16 autocast, the audio VAE is fp32 only).",
    )


DEFAULT_DEVICE = "default"


def _device_input(what: str):
    return io.Combo.Input(
        "device",
        options=[DEFAULT_DEVICE, *devices.visible_devices()],
        default=DEFAULT_DEVICE,
        optional=True,
        tooltip=f"Device the {what} computes on. default: ComfyUI's choice for it. cpu / cuda:N: that device, e.g. the "
        "text encoder on cuda:1 while the DiT samples on cuda:0; ComfyUI's memory management still loads, offloads "
        "and streams it there.",
    )


def _placed(choice: str | None, load_device, offload_device):
    """(load device, offload device) for the `device` widget: ComfyUI's pair for `default`, else the named device
    (a CPU-placed model has nowhere to offload to but the CPU)."""
    if choice in (None, DEFAULT_DEVICE):
        return load_device, offload_device
    device = devices.parse_device(choice)  # a device this machine no longer has is refused by name
    return device, device if device.type == "cpu" else offload_device


def _load(source: ModelSource, component: str, dtype: torch.dtype, load_device, offload_device, stream: bool):
    with progress_text.phases():  # bytes read, on the running loader node's bar and text
        module = source.load(component, dtype=dtype)
    return bridge.managed(module, load_device, offload_device, stream=stream)


def _fingerprint_file(folder: str, choice: str) -> str:
    if model_files.is_tiny(choice):
        # Queue time must not build the tiny H3 (~30 s with no node running: the first run's silent wait). It is
        # built from seed 0, deterministically: its name is its identity.
        return f"embedded:{choice}"
    path, _ = bridge.resolve_model_path(folder, choice)
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


class _ComponentLoader(io.ComfyNode):
    """One loader per H3 component; subclasses only say which, and from which folder."""

    NODE_ID = DISPLAY_NAME = DESCRIPTION = INPUT_ID = FOLDER = COMPONENT = FILE_HINT = ""
    FILE_COMPONENT = ""  # the weights handler a file must hold (model_files); the COMPONENT unless a DiT
    OUTPUT = None
    WEIGHT_DTYPES = ["default", "fp32"]
    STREAM = False  # layers stream under ComfyUI's low-VRAM loading (the big ones: text encoder, DiT)

    @staticmethod
    def devices():
        return mm.vae_device(), mm.vae_offload_device()

    @classmethod
    def what(cls) -> str:
        return cls.DISPLAY_NAME.removeprefix("Load MiniMax H3 ")

    @classmethod
    def extra_inputs(cls) -> list:
        """Widgets between the file and weight_dtype (the DiT's partition); their order is saved workflows'."""
        return []

    @classmethod
    def define_schema(cls):
        # Built on every /object_info and prompt validation: header reads are cached, the list bounded in time.
        listed = model_files.listing(cls.FOLDER, cls.FILE_COMPONENT or cls.COMPONENT)
        return Schema(
            node_id=cls.NODE_ID,
            display_name=cls.DISPLAY_NAME,
            category=LOADERS_CATEGORY,
            description=cls.DESCRIPTION,
            inputs=[
                io.Combo.Input(
                    cls.INPUT_ID,
                    options=listed.options,
                    tooltip=f"The {cls.what()} file: your files in models/{cls.FOLDER} that hold it (Comfy-Org "
                    f"{cls.FILE_HINT}), then model folders in models/minimax_h3, then the embedded tiny H3 (random "
                    "weights: its outputs are noise; for trying a graph out)." + listed.tooltip_note(cls.FOLDER),
                ),
                *cls.extra_inputs(),
                _weight_dtype_input(cls.WEIGHT_DTYPES, cls.what()),
                _device_input(cls.what()),
            ],
            outputs=[cls.OUTPUT.Output()],
        )

    @classmethod
    def validate_inputs(cls, **inputs):
        """Queue time, no model loaded: the file is there and holds this loader's component (its header says)."""
        problems = [problem for problem in declared_problems(cls, inputs) if problem[0] != cls.INPUT_ID]
        wrong = model_files.problems(cls.FOLDER, cls.FILE_COMPONENT or cls.COMPONENT, inputs.get(cls.INPUT_ID),
                                     LOADER_OF)
        return report(([(cls.INPUT_ID, wrong)] if wrong else []) + problems)

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        widgets = [inputs.get(spec.id) for spec in cls.extra_inputs()]
        return "|".join(str(part) for part in (
            _fingerprint_file(cls.FOLDER, inputs[cls.INPUT_ID]), *widgets, inputs.get("weight_dtype", "default"),
            inputs.get("device", DEFAULT_DEVICE),
        ))

    @classmethod
    def slot(cls, inputs: dict) -> str:
        """The pipeline component this load fills (the DiT's depends on the file or its partition widget)."""
        return cls.COMPONENT

    @classmethod
    def execute(cls, weight_dtype: str = "default", device: str = DEFAULT_DEVICE, **inputs) -> io.NodeOutput:
        load_device, offload_device = _placed(device, *cls.devices())
        # The rule is the machine's (its compute device), not the load device's: under --lowvram / --novram ComfyUI
        # runs text encoders on the CPU, where float32 would make the 32B encoder 4x its bf16 file in RAM. A device
        # the user names is the rule's device.
        rule_device = mm.get_torch_device() if device in (None, DEFAULT_DEVICE) else load_device
        if model_files.is_tiny(inputs[cls.INPUT_ID]) and model_files.tiny_needs_build():
            with progress_text.PhaseText() as text:  # one call with no sub-steps: the heartbeat shows it working
                text.show("build_tiny")
                bridge.tiny_dir()
        slot = cls.slot(inputs)
        dtype = dtypes.compute_dtype(slot, rule_device, weight_dtype)
        source = _source(cls.FOLDER, inputs[cls.INPUT_ID], slot)
        patcher = _load(source, slot, dtype, load_device, offload_device, cls.STREAM)
        return io.NodeOutput(LoadedModel(patcher, source, source.fingerprint(), cls.extra(source, slot), dtype))

    @classmethod
    def extra(cls, source: ModelSource, slot: str) -> dict:
        return {}


class TextEncoderLoader(_ComponentLoader):
    NODE_ID, DISPLAY_NAME = "H3SplitTextEncoderLoader", "Load MiniMax H3 Text Encoder"
    DESCRIPTION = (
        "Loads the text encoder (Qwen3-VL, with its tokenizer): ~51 GB in bf16 at full size, the largest piece. "
        "Connect it to MiniMax H3 Text Encode; MiniMax H3 Remote Encode can run it on another machine instead."
    )
    INPUT_ID, FOLDER, COMPONENT = "text_encoder", "text_encoders", "text_encoder"
    FILE_HINT, OUTPUT = "qwen3vl_32b_minimax_h3_*.safetensors, or a GGUF file", TextEncoder
    WEIGHT_DTYPES, STREAM = ["default", "bf16", "fp32"], True

    @staticmethod
    def devices():
        return mm.text_encoder_device(), mm.text_encoder_offload_device()

    @classmethod
    def extra(cls, source: ModelSource, slot: str) -> dict:
        return {"tokenizer": source.load_tokenizer(), "processor": source.load_processor()}


class VideoVAELoader(_ComponentLoader):
    NODE_ID, DISPLAY_NAME = "H3SplitVideoVAELoader", "Load MiniMax H3 Video VAE"
    DESCRIPTION = (
        "Loads the video VAE: it encodes keyframes and visual references, and decodes the output video. Connect it "
        "to MiniMax H3 Video VAE Encode and VAE Decode."
    )
    INPUT_ID, FOLDER, COMPONENT = "vae", "vae", "vae"
    FILE_HINT, OUTPUT = "minimax_h3_video_vae_fp16.safetensors", VideoVAE
    WEIGHT_DTYPES = ["default", "fp32", "bf16", "fp16"]


class AudioVAELoader(_ComponentLoader):
    NODE_ID, DISPLAY_NAME = "H3SplitAudioVAELoader", "Load MiniMax H3 Audio VAE"
    DESCRIPTION = (
        "Loads the audio VAE: it encodes reference audio and soundtracks, and decodes the output's stereo sound. "
        "Connect it to MiniMax H3 Audio VAE Encode and VAE Decode."
    )
    INPUT_ID, FOLDER, COMPONENT = "audio_vae", "vae", "audio_vae"
    FILE_HINT, OUTPUT = "minimax_h3_audio_vae_fp32.safetensors", AudioVAE


PARTITIONS = {"fl2va (t2va, first/last frame)": "transformer", "ref2va (references)": "transformer_ref"}


class DiTLoader(_ComponentLoader):
    """The DiT: one partition of it. A file says which (its name token, read by weights.detect); the `partition`
    widget, kept so saved workflows load unchanged, picks it from a model folder (which holds both) and for a file
    that does not say. A file that says is never overruled by the widget, so the two cannot contradict."""

    NODE_ID, DISPLAY_NAME = "H3SplitDiTLoader", "Load MiniMax H3 DiT"
    DESCRIPTION = (
        "Loads the DiT, the model that makes the video and sound (33B at full size). The fl2va file serves text-only "
        "and first/last-frame jobs, the ref2va file reference jobs; a file says which it is (`partition` matters "
        "only for a model folder). Connect it to MiniMax H3 Sampler."
    )
    INPUT_ID, FOLDER, COMPONENT, FILE_COMPONENT = "dit", "diffusion_models", "transformer", model_files.DIT
    FILE_HINT, OUTPUT = "minimax_h3_{fl2va,ref2va}_bf16.safetensors, or a GGUF file, also from models/unet", DiT
    WEIGHT_DTYPES, STREAM = ["default", "bf16", "fp32"], True

    @staticmethod
    def devices():
        return mm.get_torch_device(), mm.unet_offload_device()

    @classmethod
    def extra_inputs(cls) -> list:
        return [
            io.Combo.Input(
                "partition",
                options=list(PARTITIONS),
                tooltip="Which DiT to take from a model folder in models/minimax_h3 (it holds both). A DiT file "
                "says which it is (fl2va or ref2va in its name) and that decides, whatever this shows.",
            ),
        ]

    @classmethod
    def slot(cls, inputs: dict) -> str:
        said = model_files.file_partition(cls.FOLDER, inputs[cls.INPUT_ID])
        return model_files.PARTITION_SLOTS[said] if said else PARTITIONS[inputs["partition"]]

    @classmethod
    def extra(cls, source: ModelSource, slot: str) -> dict:
        return {"partition": slot}


NODES = [TextEncoderLoader, VideoVAELoader, AudioVAELoader, DiTLoader]
LOADER_OF = {loader.FILE_COMPONENT or loader.COMPONENT: loader.DISPLAY_NAME for loader in NODES}
