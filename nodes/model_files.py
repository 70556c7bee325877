"""What a loader's model file holds, read from its header: the loader's list and its queue-time checks.

A file's component (text encoder, video VAE, audio VAE, DiT) and a DiT's partition are decided by
`h3_core.weights.detect` from the safetensors / GGUF header alone (the Comfy-Org DiT files carry their partition
in the name token, which detect reads too); no tensor is read and no model is built. The answer is cached by
(path, size, mtime), so listing a folder of 60 GB files costs one header read per file once, and a file
replaced in place is read again.

ComfyUI builds the loaders' lists (`/object_info`) and validates prompts on its event loop, so headers are read on
a small worker pool and a list waits for them `LIST_WAIT_S` at most, whatever the folder holds: a file not read by
then is left out of this list (and listed by the next one once read), never a stalled server. A file that cannot be
read or recognised is left out by name, its reason logged once, and never costs its neighbours their place.

Loaders list the user's files of their component first, then the model folders of models/minimax_h3, then the
embedded tiny H3's entries (the tiny's own files, filtered by their fixed names: listing never builds it).
"""

from __future__ import annotations

import logging
import os
import stat as stat_module
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from ..h3_core import weights
from ..h3_core.models import COMPONENT_NAMES
from . import comfy_bridge as bridge

# The loaders' components (the weights handler names); the DiT's two partitions are one component here.
DIT = "transformer"
TINY_NAME_TOKENS = {"text_encoder": "qwen3vl_", "vae": "_video_vae_", "audio_vae": "_audio_vae_", DIT: "2va"}
PARTITION_SLOTS = {"fl2va": "transformer", "ref2va": "transformer_ref"}


@dataclass(frozen=True)
class Identity:
    component: str | None  # weights handler name: transformer, vae, audio_vae, text_encoder (None: unreadable)
    partition: str | None = None  # fl2va / ref2va for a DiT file that says which (its name token)
    problem: str | None = None  # why the header could not be read or recognised
    pending: bool = False  # still being read when the caller stopped waiting (not cached)

    @property
    def label(self) -> str:
        if self.component == DIT:
            return COMPONENT_NAMES[PARTITION_SLOTS[self.partition]] if self.partition else "DiT"
        return COMPONENT_NAMES.get(self.component, self.component or "unknown")


_CACHE: dict[tuple[str, int, int], Identity] = {}
_CACHE_LIMIT = 4096
# Header reads run here, off ComfyUI's event loop; two workers, so one read stuck on a dead network share leaves
# the other files readable.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="h3-headers")
_PENDING: dict[tuple[str, int, int], Future] = {}
_LOCK = threading.Lock()
# How long one list (or one queue-time check) waits for header reads, all its files together. A bounded GGUF header
# reads in well under 0.1 s and a safetensors header in milliseconds; a 60 GB file's header on a spinning disk or
# a network share may take a second or so.
LIST_WAIT_S = 3.0
EXECUTE_WAIT_S = 60.0  # execute time runs on ComfyUI's executor thread, not its event loop: it may wait longer
_log = logging.getLogger(__name__)


def _read(path: Path, key: tuple[str, int, int]) -> Identity:
    """Detect one file (a pool thread): cached, and when unreadable its reason logged once (the cache entry)."""
    try:
        detection = weights.detect(str(path))
        found = Identity(detection.component, detection.partition)
    except Exception as error:  # noqa: BLE001 - any file a user drops in must list (or refuse), never crash
        found = Identity(None, problem=str(error).replace(str(path.parent) + os.sep, ""))
        level = logging.INFO if isinstance(error, weights.UnrecognisedCheckpointError) else logging.WARNING
        _log.log(level, "MiniMax H3: %s is left out of the loader lists: %s", path, found.problem)
    with _LOCK:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        _CACHE[key] = found
        _PENDING.pop(key, None)
    return found


def identify(path: Path, wait: float = LIST_WAIT_S) -> Identity:
    """The component a single file holds, from its header (cached by path, size and mtime); a read that takes more
    than `wait` seconds goes on in the background and answers `pending` now."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        found = _CACHE.get(key)
        if found is not None:
            return found
        if not stat_module.S_ISREG(stat.st_mode):
            return Identity(None, problem="not a regular file")  # a FIFO or device would block the header read
        future = _PENDING.get(key)
        if future is None:
            future = _PENDING[key] = _POOL.submit(_read, path, key)
    try:
        return future.result(timeout=max(wait, 0.0))
    except FutureTimeout:
        return Identity(None, problem="its header is still being read, past this list's wait (a slow disk or share, "
                        "or a file built to stall readers)", pending=True)


def is_tiny(choice: str) -> bool:
    return choice == bridge.TINY_CHOICE or choice.startswith(bridge.TINY_FILE_PREFIX)


def tiny_needs_build() -> bool:
    """Whether resolving an embedded-tiny choice will build the tiny H3 first (as `comfy_bridge.tiny_dir` does)."""
    import folder_paths

    preset = os.environ.get("H3_TINY_DIR")
    if preset and (Path(preset) / "tiny.json").is_file():
        return False
    bridge.register_model_folder()
    return not (Path(folder_paths.get_folder_paths(bridge.PACK_FOLDER)[0]) / "tiny" / "tiny.json").is_file()


def _is_model_folder(choice: str) -> bool:
    return choice.startswith(bridge.PACK_FOLDER + "/")


def choices(folder: str, component: str) -> list[str]:
    """The loader's list: the user's files of `component`, then model folders, then the embedded tiny H3."""
    listed = bridge.model_choices(folder)
    files, folders, tiny = [], [], []
    deadline = time.monotonic() + LIST_WAIT_S  # one bound for the whole list, however many files it reads
    for choice in listed:
        if is_tiny(choice):
            name = choice.removeprefix(bridge.TINY_FILE_PREFIX)
            if choice == bridge.TINY_CHOICE or TINY_NAME_TOKENS[component] in name:
                tiny.append(choice)
        elif _is_model_folder(choice):
            folders.append(choice)
        else:
            try:
                path, _ = bridge.resolve_model_path(folder, choice)
                if identify(path, deadline - time.monotonic()).component == component:
                    files.append(choice)
            except (OSError, ValueError):
                continue  # vanished since listing, or not a file a loader takes
    return files + folders + tiny


def problems(folder: str, component: str, choice: str, loader_of: dict[str, str]) -> str | None:
    """Why `choice` cannot load as `component` (missing, unreadable, another component), known without loading:
    None when it can (or when only loading can tell: the embedded tiny H3, a model folder's contents)."""
    if not isinstance(choice, str) or is_tiny(choice):
        return None  # the tiny's names are checked when it resolves (a fixed list; resolving may build it)
    try:
        path, whole_folder = bridge.resolve_model_path(folder, choice)
    except FileNotFoundError:
        return (f"{choice} is not in models/{folder}/: download it there (the template's model list links it), "
                "or pick a file this list shows")
    except (OSError, ValueError) as error:
        return str(error)
    if whole_folder:
        return None
    found = identify(path)
    if found.pending:
        return f"{choice}: {found.problem}; queue the prompt again in a moment"
    if found.component is None:
        return f"{choice} is not an H3 model file this loader reads: {found.problem}"
    if found.component != component:
        wanted = "DiT" if component == DIT else COMPONENT_NAMES.get(component, component)
        return (f"{choice} holds the H3 {found.label}, not the {wanted}: "
                f"load it with {loader_of.get(found.component, 'the H3 loader of that component')}")
    return None


def file_partition(folder: str, choice: str) -> str | None:
    """fl2va / ref2va when `choice` is a DiT file that says its partition; None for a model folder (or a file
    that does not say). Resolving the tiny H3's files may build it, so this runs at execute time only."""
    path, whole_folder = bridge.resolve_model_path(folder, choice)
    return None if whole_folder else identify(path, wait=EXECUTE_WAIT_S).partition
