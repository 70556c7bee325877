"""Save / Load Conditioning: the contract as one safetensors file, so encoding can happen on one
machine and sampling on another with no network between them. Never pickle: the file is plain
tensors plus a versioned JSON header, validated again when loaded."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from ..h3_core import assembly
from ..h3_core.contract import H3Conditioning
from .types import CATEGORY


def _conditioning_files() -> list[str]:
    root = Path(folder_paths.get_input_directory())
    if not root.is_dir():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.safetensors") if p.is_file())


class SaveConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitSaveConditioning",
            display_name="H3 Save Conditioning",
            category=f"{CATEGORY}/io",
            description="Writes the complete H3 conditioning to output/ as .safetensors (tensors + a versioned JSON "
            "header; no pickle). Copy it to another machine's input/ and use H3 Load Conditioning there.",
            inputs=[
                io.Conditioning.Input("conditioning"),
                io.String.Input("filename_prefix", default="h3/conditioning"),
            ],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, conditioning, filename_prefix) -> io.NodeOutput:
        cond = assembly.conditioning_from_core(conditioning)
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory()
        )
        filename = f"{name}_{counter:05}_.safetensors"
        cond.save(os.path.join(folder, filename))
        return io.NodeOutput(ui=ui.PreviewText(f"{cond.task} {cond.width}x{cond.height} {cond.num_frames} frames -> "
                                               f"{os.path.join(subfolder, filename)}"))


class LoadConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitLoadConditioning",
            display_name="H3 Load Conditioning",
            category=f"{CATEGORY}/io",
            description="Reads an H3 conditioning .safetensors from input/ (written by H3 Save Conditioning, "
            "`python -m h3_core encode` or the encoder server) and validates it before use.",
            inputs=[io.Combo.Input("conditioning_file", options=_conditioning_files(),
                                   tooltip="A .safetensors conditioning file in ComfyUI's input folder.")],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def _path(cls, conditioning_file) -> str:
        return folder_paths.get_annotated_filepath(conditioning_file)

    @classmethod
    def fingerprint_inputs(cls, conditioning_file):
        with open(cls._path(conditioning_file), "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()

    @classmethod
    def validate_inputs(cls, conditioning_file):
        if not folder_paths.exists_annotated_filepath(conditioning_file):
            return f"conditioning file not found in input/: {conditioning_file}"
        return True

    @classmethod
    def execute(cls, conditioning_file) -> io.NodeOutput:
        return io.NodeOutput(H3Conditioning.load(cls._path(conditioning_file)).to_comfy())


NODES = [SaveConditioning, LoadConditioning]
