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
from .types import CONDITIONING_CATEGORY

OUTPUT_FOLDER = "h3"  # output/h3/: where MiniMax H3 Save Conditioning writes by default; listed read-only
OUTPUT_MARK = " [output]"  # core's annotation of a file in output/ (folder_paths.annotated_filepath)
EMPTY_CHOICE = ("(no conditioning file yet: MiniMax H3 Save Conditioning writes them to output/h3/, or upload a "
                ".safetensors conditioning into input/)")


def _listed(root: Path) -> list[str]:
    """Regular .safetensors files whose real path is inside `root`, relative to it (a symlink out of it, a FIFO or
    a device named *.safetensors is not listed)."""
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


def _output_root() -> Path:
    return Path(folder_paths.get_output_directory()) / OUTPUT_FOLDER


def _conditioning_files() -> list[str]:
    """The node's choices: input/'s files by their name, then output/h3/'s as `h3/NAME [output]`."""
    return _listed(Path(folder_paths.get_input_directory())) + [
        f"{OUTPUT_FOLDER}/{name}{OUTPUT_MARK}" for name in _listed(_output_root())
    ]


def _choices() -> list[str]:
    return _conditioning_files() or [EMPTY_CHOICE]


def resolve_conditioning(name: str) -> Path:
    """A workflow's file name -> its real path, only if it is one of the node's own choices.

    ComfyUI 0.3.75 does not hold V3 combo values to their options, so a workflow can name anything
    (`/etc/passwd`, `../../x`, a FIFO, `/dev/zero`). Only `stat` runs before this returns: nothing is opened.
    """
    if name == EMPTY_CHOICE:
        raise safe_paths.UnsafePathError(f"conditioning_file: no file chosen {EMPTY_CHOICE}")
    if not isinstance(name, str) or name not in _conditioning_files():
        shown = name if isinstance(name, str) and len(name) <= 200 else f"{str(name)[:200]}..."
        raise safe_paths.UnsafePathError(
            f"conditioning_file {shown!r} is not one of the .safetensors files in ComfyUI's input folder or in "
            f"output/{OUTPUT_FOLDER}/ (names are relative to input/, or 'h3/NAME [output]'; absolute paths, '..', "
            "symlinks out of those folders, FIFOs and devices are refused)")
    if name.endswith(OUTPUT_MARK):
        return safe_paths.resolve_file(_output_root(), name[len(OUTPUT_FOLDER) + 1:-len(OUTPUT_MARK)],
                                       what="conditioning_file", folder_label=f"ComfyUI's output/{OUTPUT_FOLDER}")
    return safe_paths.resolve_file(folder_paths.get_input_directory(), name, what="conditioning_file",
                                   folder_label="ComfyUI's input folder")


def listed_name(path: Path) -> str | None:
    """How MiniMax H3 Load Conditioning lists a file Save just wrote, or None when it is outside the listed folders."""
    try:
        return f"{OUTPUT_FOLDER}/{Path(path).resolve().relative_to(_output_root().resolve()).as_posix()}{OUTPUT_MARK}"
    except ValueError:
        return None


class SaveConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitSaveConditioning",
            display_name="MiniMax H3 Save Conditioning",
            category=CONDITIONING_CATEGORY,
            description="Saves the finished conditioning to a .safetensors file in output/, so later runs (here or on "
            "another machine) skip the encoders. Connect the last encode node (or any core conditioning node after "
            "it). MiniMax H3 Load Conditioning lists output/h3/ on this machine; on another one, upload the file "
            "(or copy it into input/).",
            inputs=[
                io.Conditioning.Input("conditioning"),
                io.String.Input("filename_prefix", default=f"{OUTPUT_FOLDER}/conditioning",
                                tooltip="Path under output/, then _NNNNN_.safetensors. Under h3/ the file is listed "
                                "by MiniMax H3 Load Conditioning."),
            ],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, conditioning, filename_prefix) -> io.NodeOutput:
        cond = assembly.conditioning_from_core(conditioning)  # edits by core nodes are what is saved
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory()
        )
        filename = f"{name}_{counter:05}_.safetensors"
        path = os.path.join(folder, filename)
        cond.save(path)
        listed = listed_name(Path(path))
        where = (f"MiniMax H3 Load Conditioning lists it as {listed!r}" if listed else
                 f"outside output/{OUTPUT_FOLDER}/: copy it into input/ (or upload it) for "
                 "MiniMax H3 Load Conditioning")
        return io.NodeOutput(ui=ui.PreviewText(
            f"saved {os.path.join(subfolder, filename)} ({cond.task} {cond.width}x{cond.height}, "
            f"{cond.num_frames} frames); {where}"))


class LoadConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3SplitLoadConditioning",
            display_name="MiniMax H3 Load Conditioning",
            category=CONDITIONING_CATEGORY,
            description="Loads a saved conditioning (from MiniMax H3 Save Conditioning, `python -m h3_core encode` or "
            "the encoder server) and checks it before use, so the graph needs no encoders: connect it to MiniMax H3 "
            "Sampler. Pick a file in input/ or, read-only, in output/h3/; upload puts a file into input/.",
            inputs=[io.Combo.Input("conditioning_file", options=_choices(), upload=io.UploadType.model,
                                   tooltip="A .safetensors conditioning file in input/, or 'h3/NAME [output]' for "
                                   "one MiniMax H3 Save Conditioning wrote to output/h3/.")],
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
