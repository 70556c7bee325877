"""Save / Load Conditioning: the contract as one safetensors file, so encoding can happen on one
machine and sampling on another with no network between them. Never pickle: the file is plain
tensors plus a versioned JSON header, validated again when loaded."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from ..h3_core import assembly, safe_paths
from ..h3_core.contract import H3Conditioning
from .types import CONDITIONING_CATEGORY, Schema

log = logging.getLogger(__name__)

OUTPUT_FOLDER = "h3"  # output/h3/: where MiniMax H3 Save Conditioning writes by default; listed read-only
OUTPUT_MARK = " [output]"  # core's annotation of a file in output/ (folder_paths.annotated_filepath)
EMPTY_CHOICE = ("(no conditioning file yet: MiniMax H3 Save Conditioning writes them to output/h3/, or upload a "
                ".safetensors conditioning into input/)")

# input/ is writable by anyone who can reach ComfyUI (core's /upload/image takes a `subfolder`), and the choices are
# listed in the server's event loop on every /object_info: the walk is bounded in depth and in entries so that
# thousands of uploaded files or folders nested hundreds deep cost milliseconds, never seconds or a RecursionError.
MAX_LIST_DEPTH = 3  # folders below the root: input/a/b/c/x.safetensors is listed, input/a/b/c/d/x.safetensors not
MAX_LIST_ENTRIES = 10_000  # directory entries examined per root before the walk stops (files and folders alike)
MAX_LIST_FILES = 1_000  # choices per root: a combo of more is no use to anyone and bloats /object_info
LIST_CACHE_MAX_AGE_S = 60.0  # a cached listing is also redone after this long, whatever the mtimes say


class _Listing:
    """One root's listing and the mtimes of the folders it walked: valid while none of them changed (an upload or a
    save changes its folder's mtime), so repeated /object_info calls only stat those folders."""

    def __init__(self, names: list[str], folders: list[tuple[str, int]], made: float):
        self.names, self.folders, self.made = names, folders, made

    def fresh(self) -> bool:
        if time.monotonic() - self.made > LIST_CACHE_MAX_AGE_S:
            return False
        for folder, mtime in self.folders:
            try:
                if os.stat(folder).st_mtime_ns != mtime:
                    return False
            except OSError:
                return False
        return True


_cache: dict[str, _Listing] = {}
_cache_lock = threading.Lock()


def _walk(root: str) -> _Listing:
    """Regular .safetensors files whose real path is inside `root`, relative to it, at most `MAX_LIST_DEPTH` folders
    down, after at most `MAX_LIST_ENTRIES` entries (a symlink out of it, a FIFO or a device named *.safetensors is
    not listed; symlinked folders are not entered, as pathlib's rglob does not). Iterative: no recursion to
    exhaust."""
    names: list[str] = []
    folders: list[tuple[str, int]] = []
    examined, stopped = 0, None
    pending = [(root, "", 0)]  # (folder, its name relative to root with a trailing "/", its depth)
    while pending and stopped is None:
        folder, prefix, depth = pending.pop()
        try:
            folders.append((folder, os.stat(folder).st_mtime_ns))
            with os.scandir(folder) as entries:
                for entry in entries:
                    examined += 1
                    if examined > MAX_LIST_ENTRIES:
                        stopped = f"after {MAX_LIST_ENTRIES} entries"
                        break
                    name = prefix + entry.name
                    if entry.is_dir(follow_symlinks=False):
                        if depth < MAX_LIST_DEPTH:
                            pending.append((entry.path, name + "/", depth + 1))
                        continue
                    if not entry.name.lower().endswith(".safetensors"):
                        continue
                    try:
                        safe_paths.resolve_file(root, name)
                    except safe_paths.UnsafePathError:
                        continue
                    names.append(name)
                    if len(names) >= MAX_LIST_FILES:
                        stopped = f"at {MAX_LIST_FILES} files"
                        break
        except OSError:
            continue  # a folder removed or unreadable mid-walk: list the rest
    if stopped:
        log.warning("MiniMax H3 Load Conditioning: listing of %s stopped %s (limits: %d folder levels, %d entries, "
                    "%d files); name a file deeper or later in a workflow directly, it is still checked and loaded",
                    root, stopped, MAX_LIST_DEPTH, MAX_LIST_ENTRIES, MAX_LIST_FILES)
    return _Listing(sorted(names), folders, time.monotonic())


def _listed(root: Path) -> list[str]:
    """The listing of `root` (see `_walk`), from the cache while the folders it walked are unchanged."""
    key = os.path.realpath(root)
    if not os.path.isdir(key):
        return []
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None and cached.fresh():
            return list(cached.names)
    listing = _walk(key)
    with _cache_lock:
        _cache[key] = listing
    return list(listing.names)


def _output_root() -> Path:
    return Path(folder_paths.get_output_directory()) / OUTPUT_FOLDER


def _conditioning_files() -> list[str]:
    """The node's choices: input/'s files by their name, then output/h3/'s as `h3/NAME [output]`."""
    return _listed(Path(folder_paths.get_input_directory())) + [
        f"{OUTPUT_FOLDER}/{name}{OUTPUT_MARK}" for name in _listed(_output_root())
    ]


def _choices() -> list[str]:
    return _conditioning_files() or [EMPTY_CHOICE]


def _not_a_choice(name: object, why: str) -> safe_paths.UnsafePathError:
    shown = name if isinstance(name, str) and len(name) <= 200 else f"{str(name)[:200]}..."
    return safe_paths.UnsafePathError(
        f"conditioning_file {shown!r} is not one of the .safetensors files in ComfyUI's input folder or in "
        f"output/{OUTPUT_FOLDER}/ ({why}; names are relative to input/, or 'h3/NAME [output]'; absolute paths, '..', "
        "symlinks out of those folders, FIFOs and devices are refused)")


def resolve_conditioning(name: str) -> Path:
    """A workflow's file name -> its real path, only if it names a file the node could list.

    ComfyUI 0.3.75 does not hold V3 combo values to their options, so a workflow can name anything
    (`/etc/passwd`, `../../x`, a FIFO, `/dev/zero`). The name alone is checked (never a listing of the folder: that
    would cost every prompt a walk of input/): relative, no '..', at most `MAX_LIST_DEPTH` folders deep, a regular
    .safetensors file whose real path is inside input/ or output/h3/. Only `stat` runs before this returns: nothing
    is opened.
    """
    if name == EMPTY_CHOICE:
        raise safe_paths.UnsafePathError(f"conditioning_file: no file chosen {EMPTY_CHOICE}")
    if not isinstance(name, str):
        raise _not_a_choice(name, f"a {type(name).__name__}, not a file name")
    if name.endswith(OUTPUT_MARK) and name.startswith(f"{OUTPUT_FOLDER}/"):
        root, inner, label = _output_root(), name[len(OUTPUT_FOLDER) + 1:-len(OUTPUT_MARK)], \
            f"ComfyUI's output/{OUTPUT_FOLDER}"
    else:
        root, inner, label = Path(folder_paths.get_input_directory()), name, "ComfyUI's input folder"
    if inner.replace("\\", "/").count("/") > MAX_LIST_DEPTH:
        raise _not_a_choice(name, f"more than {MAX_LIST_DEPTH} folders deep, which the node does not list")
    try:
        return safe_paths.resolve_file(root, inner, what="conditioning_file", folder_label=label)
    except safe_paths.UnsafePathError as error:
        raise _not_a_choice(name, str(error).removeprefix("conditioning_file: ")) from None


def listed_name(path: Path) -> str | None:
    """How MiniMax H3 Load Conditioning lists a file Save just wrote, or None when it is outside the listed folders."""
    try:
        return f"{OUTPUT_FOLDER}/{Path(path).resolve().relative_to(_output_root().resolve()).as_posix()}{OUTPUT_MARK}"
    except ValueError:
        return None


class SaveConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return Schema(
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
        return Schema(
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
