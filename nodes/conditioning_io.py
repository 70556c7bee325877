"""Save / Load Conditioning: the contract as one safetensors file, so encoding can happen on one
machine and sampling on another with no network between them. Never pickle: the file is plain
tensors plus a versioned JSON header, validated again when loaded."""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from ..h3_core import assembly, safe_paths
from ..h3_core.contract import H3Conditioning
from .types import CATEGORY


def _conditioning_files() -> list[str]:
    """The node's choices: regular .safetensors files whose real path is inside input/ (a symlink out of it, a
    FIFO or a device named *.safetensors is not listed)."""
    root = Path(folder_paths.get_input_directory())
    if not root.is_dir():
        return []
    names = []
    for path in root.rglob("*.safetensors"):
        name = path.relative_to(root).as_posix()
        try:
            safe_paths.resolve_file(root, name)
        except safe_paths.UnsafePathError:
            continue
        names.append(name)
    return sorted(names)


def resolve_conditioning(name: str) -> Path:
    """A workflow's file name -> its real path, only if it is one of the node's own choices.

    ComfyUI 0.3.75 does not hold V3 combo values to their options, so a workflow can name anything
    (`/etc/passwd`, `../../x`, a FIFO, `/dev/zero`). Only `stat` runs before this returns: nothing is opened.
    """
    if not isinstance(name, str) or name not in _conditioning_files():
        shown = name if isinstance(name, str) and len(name) <= 200 else f"{str(name)[:200]}..."
        raise safe_paths.UnsafePathError(
            f"conditioning_file {shown!r} is not one of the .safetensors files in ComfyUI's input folder "
            "(names are relative to input/; absolute paths, '..', symlinks out of input/, FIFOs and devices "
            "are refused)")
    return safe_paths.resolve_file(folder_paths.get_input_directory(), name, what="conditioning_file",
                                   folder_label="ComfyUI's input folder")


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
    def fingerprint_inputs(cls, conditioning_file):
        # Identity from stat alone (real path, size, mtime): queue time must not read, let alone hash, a file a
        # workflow named; execute reads it once, after the checks.
        try:
            path = resolve_conditioning(conditioning_file)
        except safe_paths.UnsafePathError:
            return "refused"  # execute raises the clear error
        info = path.stat()
        return f"{path}:{info.st_size}:{info.st_mtime_ns}:{info.st_ino}"

    @classmethod
    def validate_inputs(cls, conditioning_file):
        try:
            resolve_conditioning(conditioning_file)
        except safe_paths.UnsafePathError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, conditioning_file) -> io.NodeOutput:
        path = resolve_conditioning(conditioning_file)
        # The length prefix and JSON header first (bounded, opened without blocking): a file that is not a
        # safetensors file is refused before its body is read, and no message quotes its bytes.
        safe_paths.check_safetensors_header(path, what=f"conditioning_file {conditioning_file!r}")
        return io.NodeOutput(H3Conditioning.load(path).to_comfy())


NODES = [SaveConditioning, LoadConditioning]
