"""Which weight files a loaded module's tensors may still share pages with, and whether they changed in place.

Weights are read through `safetensors.safe_open`, and GGUF tensors through `np.memmap(mode="c")`
(`gguf_file.read_tensor`): both map the file, so on the CPU (and for weights streamed from host memory) the
parameters stay views of the file's pages. A file replaced by a rename (a new inode: what
`cp --remove-destination`, `mv`, downloaders and ComfyUI's model manager do) does not touch them: the old inode lives
until the mapping goes. A file rewritten or truncated *in place* does: its pages change under the model, and a
page past a new end of file kills the process with SIGBUS the next time it is read - no Python code can catch
that. Weight folders are the operator's (no ComfyUI upload endpoint writes to `models/`), so no remote client can
do it; what the pack can do for the operator is notice an in-place change before the next run and refuse it by
name (`check_unchanged`) instead of computing with changed weights or crashing mid-run.
"""

from __future__ import annotations

import os

import torch

from .errors import H3WeightsError

_ATTRIBUTE = "_h3_weight_files"


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def remember(module: torch.nn.Module, files) -> None:
    """Record the identity (device, inode, size, mtime) of the files `module` was loaded from."""
    setattr(module, _ATTRIBUTE, {path: _identity(path) for path in files})


def changed_in_place(module: torch.nn.Module) -> list[str]:
    """The files `module` was loaded from that were rewritten or truncated in place since (same inode, another size
    or mtime), while some of its tensors may still be views of them (any parameter or buffer on the CPU)."""
    files = getattr(module, _ATTRIBUTE, None)
    if not files or not any(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers())):
        return []
    changed = []
    for path, before in files.items():
        now = _identity(path)
        if before is not None and now is not None and now[:2] == before[:2] and now != before:
            changed.append(path)
    return changed


def check_unchanged(module: torch.nn.Module, what: str) -> None:
    """Refuse to run `module` on weights whose file changed in place after loading (see the module docstring)."""
    changed = changed_in_place(module)
    if changed:
        raise H3WeightsError(
            f"the {what} weight file {changed[0]!r} was rewritten in place after it was loaded (its size or time "
            "changed); its memory-mapped weights are no longer what was loaded. Reload the model (restart, or "
            "change the loader's choice), and replace weight files by writing a new file and renaming it over "
            "the old one")
