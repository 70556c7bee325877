"""One component's weight mapping as data, and the small helpers every mapping uses.

Each `*_keys.py` module ends with a `HANDLER = ComponentHandler(...)`: how its files are recognised
(key families and their marker keys), how its config follows from tensor shapes, how file keys
map onto the diffusers / transformers model and back, and which model class it builds (the role
diffusers' per-model `WeightMappingHandler` plays). `components.HANDLERS` collects them; detection,
`check`, the loaders and model discovery only ever go through that table, so a new component is one
new handler and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

# Layout names, shared by detection, `check` and `ModelSource`: where a file comes from.
LAYOUTS = ("diffusers", "comfyui", "native")


def rename(key: str, rules) -> str | None:
    """The first `(compiled regex, template)` rule that fully matches `key`, expanded; else None."""
    for pattern, template in rules:
        match = pattern.fullmatch(key)
        if match:
            return match.expand(template)
    return None


def count_indices(keys, pattern: str) -> int:
    """How many distinct values the first group of `pattern` takes over `keys` (layers, blocks...)."""
    regex = re.compile(pattern)
    return len({m.group(1) for key in keys if (m := regex.match(key))})


@dataclass(frozen=True)
class KeyFamily:
    """One naming of a component's tensors, recognised when every marker key is present.

    `comfy`: the Comfy-Org single files use it; `native`: MiniMaxAI's native component folders use
    it. Both False means the diffusers / transformers naming.
    """

    name: str
    markers: tuple[str, ...]
    comfy: bool = False
    native: bool = False
    test: Callable[[object], bool] | None = None  # an extra condition on the key set, if markers are not enough
    # False: the handler's `load_single_file` (diffusers' own reader) cannot read this family's Comfy files, which
    # then take the loaders' generic assign path (the pruned DiT).
    diffusers_single_file: bool = True

    def matches(self, keys) -> bool:
        return all(marker in keys for marker in self.markers) and (self.test is None or self.test(keys))


def _identity_config(stated: dict, source) -> dict:
    return stated


def _no_notes(keys, family: str) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class ComponentHandler:
    """Everything that differs between components, as one value (see the module docstring).

    Callables (all pure, header-only unless noted):
    - `derive_config(shapes, family, stated, where)`: the model config, shapes must agree with `stated`;
    - `to_model(tensors, config, family, layout)`: file tensors -> (model names, unexpected keys);
    - `from_model(state, config, family, layout)`: model state dict -> file tensors of that family;
    - `stated_config(stated, source)`: a folder's own config in the model's argument names;
    - `notes(keys, family)`: remarks for `check`'s report;
    - `build(cls, detection, config)`: the model on the meta device (default `cls.from_config`);
    - `load_single_file(detection, config, dtype)`: a loader for Comfy single files, if the generic
      assign-into-meta-model path is not the one to take (reads tensor data);
    - `after_load(detection, model, dtype)`: checks / fix-ups once weights are in (reads tensor data).
    `latent_stat_keys` are buffers a file carries that the model keeps in its config instead;
    `fp32_modules` is the dtype policy's addition to the model class's own float32 modules.
    """

    name: str  # the component's folder name in a diffusers root: what the pipeline receives
    label: str  # how messages name it
    model_class: str
    library: str  # "diffusers" | "transformers": the package holding `model_class`
    folders: tuple[str, ...]  # sub-folders of pipeline roots that hold it (diffusers root, native partition)
    families: tuple[KeyFamily, ...]  # detection order: the first family that matches wins
    derive_config: Callable
    to_model: Callable
    from_model: Callable
    stated_config: Callable = _identity_config
    notes: Callable = _no_notes
    build: Callable | None = None
    load_single_file: Callable | None = None
    after_load: Callable | None = None
    latent_stat_keys: tuple[str, ...] = ()
    # dtype policy: modules kept in float32 whatever dtype is asked for, beyond the model class's own
    # `_keep_in_fp32_modules` (matched against dotted-name components, as diffusers matches them).
    fp32_modules: tuple[str, ...] = ()
    partitioned: bool = False  # the DiT: one handler, two partitions (fl2va -> transformer, ref2va -> transformer_ref)
    # Quantised layers of a Comfy file: "keep" them quantised in memory (`QuantLinear`, dequantised per
    # layer at run time) or "dequantise" them once at load (small components, see `weights.quant.route`).
    quantised_layers: str = "keep"

    def family(self, keys) -> KeyFamily | None:
        return next((family for family in self.families if family.matches(keys)), None)

    def family_named(self, name: str) -> KeyFamily:
        return next(family for family in self.families if family.name == name)

    def keep_in_fp32(self, model_type: type) -> tuple[str, ...]:
        return (*(getattr(model_type, "_keep_in_fp32_modules", None) or ()), *self.fp32_modules)

    def model_type(self) -> type:
        import importlib

        return getattr(importlib.import_module(self.library), self.model_class)
