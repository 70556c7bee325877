"""`python -m h3_core plan`: which machine runs what, from headers only (no weights read, no GPU).

For each component file: its resident and block-streamed device peaks and the host RAM it needs; then
one verdict per machine role, with what would make a refused job fit (a smaller published file, block
streaming, or the text encoder on a remote encoder server):

* the diffusion machine holds one DiT partition and the decoders; the VAEs decode after the last DiT
  forward while a resident DiT stays loaded (a streamed one has left the device by then);
* a local encoder holds the text encoder and both VAEs at once (the stage loads them together).

With `--sp N` the DiT verdicts are per GPU of N sequence-parallel ranks (weights replicated, activations / N; rank 0
also decodes), and each DiT verdict names the smallest N, up to `MAX_RANKS`, at which the DiT fits resident.

`--table` prints the machines x files x offload table of docs/REAL_WEIGHTS.md from release-size
tensor tables built on the meta device (no file needed).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from .. import facts, rules
from . import planner
from . import tables as plan_tables

# The largest sequence-parallel degree the planner suggests (one 8-GPU node).
MAX_RANKS = 8

def smallest_resident_ranks(plan: planner.ComponentPlan, extra_for, vram: int, ram: int | None) -> int | None:
    """The fewest sequence-parallel ranks (dividing the DiT's heads, up to MAX_RANKS) at which `plan` fits resident on
    each GPU, with `extra_for` what shares rank 0's GPU; None when no degree does (the decode phase, or the weights
    alone, exceed the GPU: SP splits activations only)."""
    for ranks in range(1, MAX_RANKS + 1):
        if not plan.divides(ranks):
            continue
        if planner.decide("", plan.per_rank(ranks), extra_for, vram, ram).offload == "none":
            return ranks
    return None


def verdicts(plans: list[planner.ComponentPlan], vram: int, ram: int | None, ranks: int = 1) -> list[planner.Verdict]:
    """One verdict per DiT file (the diffusion machine, per GPU of `ranks` sequence-parallel ranks) and per
    text-encoder file (a local encoder), with the first video / audio VAE given sharing the device."""
    vae = next((p for p in plans if p.component == "vae"), None)
    audio = next((p for p in plans if p.component == "audio_vae"), None)
    decoders = sum(p.device_bytes for p in (vae, audio) if p is not None)
    decode_work = max((p.activation for p in (vae, audio) if p is not None), default=0)
    out = []
    for plan in plans:
        if plan.component in planner.DIT_COMPONENTS:
            if not plan.divides(ranks):
                raise ValueError(f"--sp {ranks}: the DiT's {plan.heads} attention heads do not divide into {ranks} "
                                 f"ranks; use a divisor of {plan.heads}")

            def decode_phase(offload, dit=plan):  # a resident DiT stays loaded while rank 0's VAEs decode
                kept = dit.device_bytes if offload == "none" else 0
                return kept + decoders + decode_work + planner.RESERVE_BYTES

            role = f"diffusion ({plan.name})" + (f" per GPU of {ranks}" if ranks > 1 else "")
            verdict = planner.decide(role, plan.per_rank(ranks), decode_phase, vram, ram)
            out.append(replace(verdict, ranks=ranks,
                               resident_from=smallest_resident_ranks(plan, decode_phase, vram, ram)))
        elif plan.component == "text_encoder":
            # the VAEs' weights share the device with the text encoder (their work comes after it)
            out.append(planner.decide(f"local encoder ({plan.name})", plan,
                               lambda offload, te=plan: te.peak(offload) + decoders, vram, ram))
    return out


def _plans_from_args(args) -> list[planner.ComponentPlan]:
    from ..models import ModelSource

    paths = list(args.files)
    if args.models:
        source = ModelSource.from_path(args.models, layout=args.layout)
        paths += [str(path) for slot, path in sorted(source.paths.items())]
    if not paths:
        raise ValueError("plan needs --models DIR or component files")
    job = {"width": args.width, "height": args.height, "frames": args.frames, "text_tokens": args.text_tokens}
    return [planner.plan_file(path, device="cuda", dtype=args.dtype, **job) for path in paths]


def _gb(value: int) -> str:
    return f"{value / planner.GB:.1f}"


def run(args) -> int:
    rules.check_canvas(args.width, args.height)  # H3's canvas and frame rules, as encode and generate apply them
    rules.check_output_frames(args.frames)
    # planned all the same: warnings, not refusals
    untrained = [rules.trained_range_warning(args.frames), rules.canvas_trained_warning(args.width, args.height)]
    warnings = [f"warning: {text}" for text in untrained if text]
    if warnings and not args.json:
        print("\n".join(warnings))
    if args.table:
        job = {"width": args.width, "height": args.height, "frames": args.frames, "text_tokens": args.text_tokens}
        print(plan_tables.machine_table(**job) + "\n\n" + plan_tables.machine_choices(**job))
        return 0
    if args.vram is None:
        raise ValueError("plan needs --vram GB (the GPU's memory)")
    if args.sp < 1:
        raise ValueError(f"--sp must be an integer >= 1 (GPUs), got {args.sp}")
    plans = _plans_from_args(args)
    vram, ram = int(args.vram * planner.GB), None if args.ram is None else int(args.ram * planner.GB)
    results = verdicts(plans, vram, ram, args.sp)
    if args.json:
        print(json.dumps({
            "components": [{
                "component": p.component, "file": p.name, "stored_bytes": p.stored_bytes,
                "resident_peak": p.resident_peak, "streamed_peak": p.streamed_peak, "activation": p.activation,
                "host_resident": p.host_bytes("none"), "host_streamed": p.host_bytes("block"), "dtype": str(p.dtype),
            } for p in plans],
            "verdicts": [{"role": v.role, "verdict": v.label, "offload": v.offload, "peak": v.peak, "host": v.host,
                          "advice": v.advice, "ranks": v.ranks, "resident_from_ranks": v.resident_from}
                         for v in results],
            "warnings": warnings,
        }, indent=2))
        return 0
    print(f"job {args.width}x{args.height}x{args.frames}, {args.text_tokens} text tokens; "
          f"GPU {args.vram:g} GB, RAM {'?' if args.ram is None else f'{args.ram:g}'} GB (GB = 1e9 bytes)")
    print(f"{'component':<16}{'file':<48}{'stored':>8}{'resident':>10}{'streamed':>10}{'activ.':>8}{'host(str.)':>11}")
    if args.sp > 1:
        print(f"DiT rows per GPU of {args.sp} sequence-parallel ranks (weights replicated, activations / {args.sp})")
    for p in plans:
        p = p.per_rank(args.sp) if p.component in planner.DIT_COMPONENTS else p
        streamed = _gb(p.streamed_peak) if p.streamable else "-"
        print(f"{p.component:<16}{p.name[:47]:<48}{_gb(p.stored_bytes):>8}{_gb(p.resident_peak):>10}"
              f"{streamed:>10}{_gb(p.activation):>8}{_gb(p.host_bytes('block')):>11}")
    for v in results:
        how = f" (--offload {v.offload})" if v.offload else ""
        sp = ""
        if v.role.startswith("diffusion"):
            sp = (f"; resident from --sp {v.resident_from}" if v.resident_from
                  else f"; no --sp up to {MAX_RANKS} fits it resident")
        print(f"{v.role}: {v.label}{how}, peak {_gb(v.peak)} GB, host RAM {_gb(v.host)} GB"
              + (f"; {v.advice}" if v.advice else "") + sp)
    return 0 if all(v.offload is not None for v in results) else 3


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `plan` on the CLI's subparsers."""
    from .. import dtypes

    plan = sub.add_parser("plan", help="memory plan of a job from the weights' headers (no weights read, no GPU)")
    plan.add_argument("files", nargs="*", help="component .safetensors files (any layout `check` names)")
    plan.add_argument("--models", help="models folder (as encode/generate take)")
    plan.add_argument("--layout", choices=("diffusers", "comfyui", "native"), help="inside a tiny output folder")
    plan.add_argument("--vram", type=float, help="GPU memory in GB (1e9 bytes)")
    plan.add_argument("--ram", type=float, help="host RAM in GB (default: not checked)")
    plan.add_argument("--width", type=int, default=1344)
    plan.add_argument("--height", type=int, default=768)
    plan.add_argument("--frames", type=int, default=facts.DEFAULT_FRAMES,
                      help=f"output frames, 17k+5 within {facts.MIN_FRAMES}..{facts.MAX_FRAMES} (outside H3's trained "
                      f"{facts.TRAINED_MIN_FRAMES}..{facts.TRAINED_MAX_FRAMES}: planned, with a warning)")
    plan.add_argument("--text-tokens", type=int, default=planner.DEFAULT_TEXT_TOKENS)
    plan.add_argument("--dtype", choices=dtypes.CHOICES, default="auto", help="compute dtype (auto: the GPU rule)")
    plan.add_argument("--sp", type=int, default=1,
                      help="sequence-parallel GPUs the DiT runs on (generate --sp): peaks per GPU (default 1)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--table", action="store_true", help="print the machines x published files table")
    plan.set_defaults(func=run)
    return plan


