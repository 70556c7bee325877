"""What a loader's model file holds, read from its header: the loader's list and its queue-time checks.

A file's component (text encoder, video VAE, audio VAE, DiT) and a DiT's partition are decided by
`h3_core.weights.detect` from the safetensors / GGUF header alone (the Comfy-Org DiT files carry their partition
in the name token, which detect reads too); no tensor is read and no model is built. The answer is cached by
(path, size, mtime), so listing a folder of 60 GB files costs one header read per file once, and a file
replaced in place is read again.

ComfyUI builds the loaders' lists (`/object_info`) and validates prompts on its event loop, so headers are read on
a small worker pool and a list waits for them `LIST_WAIT_S` at most, whatever the folder holds: a file not read by
then is left out of this list (and listed by the next one once read), never a stalled server. A file that cannot be
read or recognised never costs its neighbours their place, and its reason is logged once.

Loaders list the user's files of their component first, then the model folders of models/minimax_h3, then the
embedded tiny H3 (one entry: listing never builds it), then one `⚠ NAME — reason` entry per file of the loader's
folder that no loader can load: unreadable (an interrupted download, a corrupt header), a refused H3 variant, or an
H3 component that belongs in another folder (an audio VAE in diffusion_models). Picking such an entry is refused
at queue time with the whole reason. A readable file that holds no H3 component (another model family's file,
which core's loaders list) is left out and named in the loader's tooltip.

The tiny H3's twins (its precision, quantised, pruned and GGUF copies, which the pack's tests and the shipped
quantised API graphs select as `[embedded] tiny H3 / NAME`) are listed only with H3_SHOW_TINY_TWINS=1. A workflow that
names one still queues and runs without it: the loaders' `validate_inputs` takes **kwargs, so ComfyUI (0.3.75 and
core 0.33) leaves the combo's list check to it, and it accepts every name of the tiny's fixed list (resolved only
when the loader runs).
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
# The model folder each component's loader reads (loaders.py's FOLDER): a file of another folder's component is
# marked in its folder's lists, with where to move it.
COMPONENT_FOLDER = {"text_encoder": "text_encoders", "vae": "vae", "audio_vae": "vae", DIT: "diffusion_models"}
SHOW_TWINS_ENV = "H3_SHOW_TINY_TWINS"  # 1: list the tiny H3's twins too (tests, quantisation work)
NOTE_PREFIX, NOTE_SEP = "⚠ ", " — "  # "⚠ NAME — reason": a file the loader cannot load, and why
NOTE_REASON_CHARS = 110  # a list entry's reason is cut here (queue time and the console say it whole)
TOOLTIP_NAMES = 8  # not-H3 files named in a loader's tooltip, then a count
NOT_REGULAR = "not a regular file"


@dataclass(frozen=True)
class Identity:
    component: str | None  # weights handler name: transformer, vae, audio_vae, text_encoder (None: unreadable)
    partition: str | None = None  # fl2va / ref2va for a DiT file that says which (its name token)
    problem: str | None = None  # why the header could not be read or recognised
    pending: bool = False  # still being read when the caller stopped waiting (not cached)
    unrecognised: bool = False  # readable, but holds no H3 component (another model family's file)
    short: str | None = None  # `problem` shortened for a list entry ("not readable: incomplete file (...)")

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


def short_reason(error: BaseException, problem: str) -> str:
    """What a `⚠` list entry says about a file detect refused: the kind of trouble, not the header's numbers."""
    text = problem.split(": ", 1)[1] if ": " in problem else problem  # detect's messages start with the file
    if isinstance(error, weights.IncompleteFileError) or "truncated" in text or "incomplete file" in text:
        return "not readable: incomplete file (interrupted download?)"
    if text.startswith("not a safetensors file") or text.startswith("not a GGUF file"):
        return "not readable: " + text.split(" (", 1)[0] + " (corrupt, or another format)"
    if isinstance(error, weights.UnsupportedCheckpointError):
        return "not supported: " + text
    if isinstance(error, OSError):
        return "not readable: " + (error.strerror or text)
    return "not readable: " + text


def _read(path: Path, key: tuple[str, int, int]) -> Identity:
    """Detect one file (a pool thread): cached, and when unreadable its reason logged once (the cache entry)."""
    try:
        detection = weights.detect(str(path))
        found = Identity(detection.component, detection.partition)
    except Exception as error:  # noqa: BLE001 - any file a user drops in must list (or refuse), never crash
        problem = str(error).replace(str(path.parent) + os.sep, "")
        unrecognised = isinstance(error, weights.UnrecognisedCheckpointError)
        found = Identity(None, problem=problem, unrecognised=unrecognised, short=short_reason(error, problem))
        if unrecognised:
            _log.info("MiniMax H3: %s is left out of the loader lists (not an H3 model file; the loader's tooltip "
                      "names it): %s", path, problem)
        else:
            _log.warning("MiniMax H3: %s is left out of the loader lists (they name it with this reason): %s", path,
                         problem)
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
            # a FIFO or device would block the header read
            return Identity(None, problem=NOT_REGULAR, short="not readable: " + NOT_REGULAR)
        future = _PENDING.get(key)
        if future is None:
            future = _PENDING[key] = _POOL.submit(_read, path, key)
    try:
        return future.result(timeout=max(wait, 0.0))
    except FutureTimeout:
        return Identity(None, problem="its header is still being read, past this list's wait (a slow disk or share, "
                        "or a file built to stall readers)", pending=True)


def is_tiny(choice: str) -> bool:
    """An embedded-tiny choice, old workflows' label included (resolving one may build the tiny: never at queue
    time)."""
    return (choice == bridge.TINY_CHOICE or choice in bridge.LEGACY_TINY_CHOICES
            or choice.startswith(bridge.TINY_FILE_PREFIX))


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


def show_twins() -> bool:
    """Whether the loaders list the tiny H3's twins (H3_SHOW_TINY_TWINS=1), besides its one embedded entry."""
    return os.environ.get(SHOW_TWINS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def note(name: str, reason: str) -> str:
    """The `⚠ NAME — reason` list entry of a file the loader cannot load."""
    if len(reason) > NOTE_REASON_CHARS:
        reason = reason[:NOTE_REASON_CHARS - 1].rstrip() + "…"
    return f"{NOTE_PREFIX}{name}{NOTE_SEP}{reason}"


def noted_name(choice: str) -> str | None:
    """The file name of a `⚠` entry (None for any other choice)."""
    if not choice.startswith(NOTE_PREFIX):
        return None
    return choice[len(NOTE_PREFIX):].split(NOTE_SEP, 1)[0]


def _elsewhere(component: str) -> str:
    return f"models/{COMPONENT_FOLDER[component]}/"


_LOGGED: set[tuple] = set()  # what the listing itself logged (header reads log once through their cache entry)


def _log_once(key: tuple, message: str, *args) -> None:
    with _LOCK:
        if key in _LOGGED:
            return
        if len(_LOGGED) >= _CACHE_LIMIT:
            _LOGGED.clear()
        _LOGGED.add(key)
    _log.warning(message, *args)


def _log_misplaced(path: Path, folder: str, found: Identity) -> None:
    _log_once((str(path), folder, found), "MiniMax H3: %s is left out of the loader lists (they name it with this "
              "reason): it holds the H3 %s, which its loader reads from %s, not models/%s/", path, found.label,
              _elsewhere(found.component), folder)


@dataclass(frozen=True)
class Listing:
    options: list[str]  # the loader's combo list
    not_h3: tuple[str, ...] = ()  # readable files of the folder that hold no H3 component (left out)
    noted: int = 0  # `⚠` entries at the end of `options`

    def tooltip_note(self, folder: str) -> str:
        """What the loader's tooltip adds about the folder's files it does not offer."""
        parts = []
        if self.noted:
            parts.append(f"Entries marked ⚠ are files in models/{folder} that cannot be loaded, with the "
                         "reason (also in ComfyUI's console); picking one is refused when queued.")
        if self.not_h3:
            shown = ", ".join(self.not_h3[:TOOLTIP_NAMES])
            more = f" and {len(self.not_h3) - TOOLTIP_NAMES} more" if len(self.not_h3) > TOOLTIP_NAMES else ""
            parts.append(f"Not listed, not MiniMax H3 model files: {shown}{more}.")
        return (" " + " ".join(parts)) if parts else ""


def listing(folder: str, component: str) -> Listing:
    """The loader's list: the user's files of `component`, then model folders, then the embedded tiny H3 (its twins
    only with H3_SHOW_TINY_TWINS=1), then a `⚠` entry per file of `folder` no loader can load."""
    listed = bridge.model_choices(folder)
    twins = show_twins()
    files, folders, tiny, noted, not_h3 = [], [], [], [], []
    deadline = time.monotonic() + LIST_WAIT_S  # one bound for the whole list, however many files it reads
    for choice in listed:
        if is_tiny(choice):
            name = choice.removeprefix(bridge.TINY_FILE_PREFIX)
            if choice == bridge.TINY_CHOICE or (twins and TINY_NAME_TOKENS[component] in name):
                tiny.append(choice)
        elif _is_model_folder(choice):
            folders.append(choice)
        else:
            try:
                path, _ = bridge.resolve_model_path(folder, choice)
                found = identify(path, deadline - time.monotonic())
            except (OSError, ValueError):
                continue  # vanished since listing, or not a file a loader takes
            if found.component == component:
                files.append(choice)
            elif found.pending:
                continue  # listed (or marked) by a later list, once read
            elif found.component is None:
                if found.unrecognised:
                    if "mmproj" not in choice.rsplit("/", 1)[-1].lower():  # a GGUF text encoder's vision file
                        not_h3.append(choice)
                else:
                    if found.problem == NOT_REGULAR:  # never read, so never logged by _read
                        _log_once((str(path), NOT_REGULAR), "MiniMax H3: %s is left out of the loader lists (they "
                                  "name it with this reason): %s", path, NOT_REGULAR)
                    noted.append(note(choice, found.short or "not readable"))
            elif COMPONENT_FOLDER.get(found.component, folder) != folder:
                _log_misplaced(path, folder, found)
                noted.append(note(choice, f"holds the H3 {found.label}: move it to {_elsewhere(found.component)}"))
            # else: another loader of this folder lists it (the audio VAE beside the video VAE in models/vae)
    return Listing(files + folders + tiny + noted, tuple(not_h3), len(noted))


def choices(folder: str, component: str) -> list[str]:
    """The loader's list (`listing`)."""
    return listing(folder, component).options


def problems(folder: str, component: str, choice: str, loader_of: dict[str, str]) -> str | None:
    """Why `choice` cannot load as `component` (missing, unreadable, another component), known without loading:
    None when it can (or when only loading can tell: the embedded tiny H3, a model folder's contents)."""
    if not isinstance(choice, str) or is_tiny(choice):
        return None  # the tiny's names are checked when it resolves (a fixed list; resolving may build it)
    name = noted_name(choice)
    if name is None:
        return _file_problem(folder, component, choice, loader_of)
    wrong = _file_problem(folder, component, name, loader_of)  # a name of the folder's listing, never a path
    return wrong or (f"{name} was marked ⚠ when this list was built and reads now: refresh the node "
                     f"definitions (press R) and pick {name}")


def _file_problem(folder: str, component: str, choice: str, loader_of: dict[str, str]) -> str | None:
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
        loader = loader_of.get(found.component, "the H3 loader of that component")
        if COMPONENT_FOLDER.get(found.component, folder) != folder:
            return (f"{choice} holds the H3 {found.label}, not the {wanted}: move it to {_elsewhere(found.component)} "
                    f"and load it with {loader}")
        return f"{choice} holds the H3 {found.label}, not the {wanted}: load it with {loader}"
    return None


def file_partition(folder: str, choice: str) -> str | None:
    """fl2va / ref2va when `choice` is a DiT file that says its partition; None for a model folder (or a file
    that does not say). Resolving the tiny H3's files may build it, so this runs at execute time only."""
    path, whole_folder = bridge.resolve_model_path(folder, choice)
    return None if whole_folder else identify(path, wait=EXECUTE_WAIT_S).partition
