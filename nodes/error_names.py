"""Exception types that read as the pack's in ComfyUI's error report.

ComfyUI imports a custom node pack under its file-system path, so `H3InputError` reached "Show Report" as
"/…/custom_nodes/comfyui-minimax-h3.h3_core.rules.H3InputError" (execution.py's full_type_name is the class's
`__module__` + name). Renaming the `__module__` of the pack's own exception classes to a dotted name under
`minimax_h3` gives "minimax_h3.h3_core.rules.H3InputError": the same class, the same module, no path. Nothing
in the pack pickles classes or looks them up by `__module__`.
"""

from __future__ import annotations

import sys

PUBLIC_ROOT = "minimax_h3"


def public_module_name(module_name: str, pack_root: str) -> str:
    return PUBLIC_ROOT + module_name.removeprefix(pack_root)


def rename(pack_root: str) -> int:
    """Renames the exception classes defined in the pack's loaded modules; returns how many."""
    renamed = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == pack_root or module_name.startswith(pack_root + ".")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module_name:
                value.__module__ = public_module_name(module_name, pack_root)
                renamed += 1
    return renamed
