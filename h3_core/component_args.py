"""CLI component files: `--dit`, `--text-encoder`, `--vae`, `--audio-vae` for `encode` and `generate`.

Each names one single file (any format the loaders read: full or pruned DiT, bf16 or quantised) and overrides
what `--models` would pick for that component; with all the components a command needs given, `--models` may be
left out. The file's own header decides what it is: a flag given the wrong component is refused, and a DiT file
of the other partition than the task's is refused too (a file whose name carries no fl2va/ref2va token is taken
as the partition the task needs).
"""

from __future__ import annotations

import argparse

# flag attribute -> (flag, pipeline slot it fills; None: the DiT, whose slot the partition decides)
FLAGS = {
    "dit": ("--dit", None),
    "text_encoder": ("--text-encoder", "text_encoder"),
    "vae": ("--vae", "vae"),
    "audio_vae": ("--audio-vae", "audio_vae"),
}


def add_component_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("component files (each overrides what --models picks)")
    group.add_argument("--dit", help="DiT single file (diffusion_models/: full, pruned or quantised; generate only)")
    group.add_argument("--text-encoder", help="text encoder single file (text_encoders/; encode only)")
    group.add_argument("--vae", help="video VAE single file (vae/)")
    group.add_argument("--audio-vae", help="audio VAE single file (vae/)")


def given(args) -> dict[str, str]:
    """The component files given on the command line: flag attribute -> path."""
    return {name: getattr(args, name) for name in FLAGS if getattr(args, name, None)}


def _dit_slot(path: str, task: str | None) -> str:
    from . import weights
    from .models import PARTITION_OF_TASK, ModelSourceError

    wanted = PARTITION_OF_TASK.get(task) if task else None
    partition = weights.detect(path).partition
    if partition is None:
        return wanted or "transformer"
    slot = weights.components.PARTITION_SLOTS[partition]
    if wanted is not None and slot != wanted:
        need = {"transformer": "fl2va", "transformer_ref": "ref2va"}[wanted]
        raise ModelSourceError(f"{path} is the {partition} DiT, but a {task} request needs the {need} DiT")
    return slot


def model_source(args, task: str | None = None):
    """The `ModelSource` of `--models` (if given) with the component files put in; `task` picks the DiT's slot."""
    from . import weights  # torch and the loaders only when a command loads models
    from .models import ModelSource, ModelSourceError

    files = given(args)
    source = ModelSource.from_path(args.models, layout=args.layout) if args.models else None
    if source is None and not files:
        raise ModelSourceError(
            "no models: pass --models, or component files (" + ", ".join(flag for flag, _ in FLAGS.values()) + ")"
        )
    for name, path in files.items():
        flag, slot = FLAGS[name]
        try:
            slot = slot or _dit_slot(path, task)
            single = ModelSource.for_file(slot, path)
        except weights.H3WeightsError as error:
            raise ModelSourceError(f"{flag}: {error}") from error
        except ModelSourceError as error:
            raise ModelSourceError(f"{flag}: {error}") from error
        if source is None:
            source = single
        else:
            source.paths[slot] = single.paths[slot]
            if slot in single.detections:  # the file's detection travels with it: the load does not detect again
                source.detections[slot] = single.detections[slot]
    return source
