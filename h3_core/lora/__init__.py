"""LoRAs for the H3 DiT (Turbo and PDD distillations, style LoRAs), applied without touching the weights.

Files are read as safetensors only. `formats.py` maps every trainer's naming (Comfy-Org / reference / ai-toolkit
native names, musubi-tuner's flattened `lora_unet_`, DiffSynth-Studio's peft `.default.` with per-head interleaved
qkv, diffusers' own) onto diffusers' module names; a tensor it cannot place is an error naming it, never dropped.

The low-rank update runs beside each targeted Linear as a forward hook, y = W x + s * B (A x), the way an unmerged
peft adapter computes it (peft itself is not needed). Nothing is written into the weights, so leaving `applied(...)`
restores the DiT exactly, and one loaded DiT serves requests with and without the LoRA. A quantised layer
(`QuantLinear`, from an int8 / fp8 / w6a8 file) gets the same branch inside its forward (`QuantLinear.add_lora`):
its codes are never re-quantised. Several LoRAs stack (`LoRAStack`): each adds its own branch at its own strength.

PDD "Acc" LoRAs (alibaba-pai) carry a bank of N output heads, one per interval of an N-point grid on the unshifted
time axis; a sampling step from grid point a to b uses the mean of heads a..b-1 weighted by each interval's length in
the stream's own shifted sigma (video shift for `proj_out`, audio shift for `audio_proj_out`): the block's mean
velocity. That needs the run's schedule (`Schedule`), which `LoRAStack` carries; strength s blends the bank's output
with the base head's, base + s (bank - base).

Turbo LoRAs change the schedule too: the Turbo LoRAs' cards ask for 5 or 9 sigma points and video shift 6 or 12
(`SamplingOptions` carries both); PDD files ask for 9 (8 forwards over a 32-head grid), shifts 12 / 3.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import diffusers_adapter, facts
from .formats import (
    ADALN_MODALITIES,
    AUDIO_MODALITY,
    AUDIO_MODULES,
    HEAD_MODULES,
    LoraError,
    deinterleave_qkv,
    parse,
)

__all__ = ["LoRA", "LoRAStack", "LoraError", "Schedule", "parse_spec", "stack_for_run", "AUDIO_MODULES"]
PREFIX = "transformer."


@dataclass(frozen=True)
class Schedule:
    """What a PDD head bank needs of the run: sigma points (incl. the final 0) and the two shifts."""

    steps: int
    video_shift: float | None = None  # None: the release's (12 / 3)
    audio_shift: float | None = None


@dataclass(frozen=True)
class LoRA:
    name: str
    factors: dict = field(repr=False)  # diffusers module path -> (A [rank, in], B [out, rank], scale)
    format: str = "diffusers"
    # DiffSynth: "<block>.attn" -> (A, B rows per head [q k v], scale), split when bound to a DiT
    interleaved_qkv: dict = field(default_factory=dict, repr=False)
    heads: dict = field(default_factory=dict, repr=False)  # PDD: "proj_out" / "audio_proj_out" -> (kind, W, b)
    skipped: tuple = ()  # what `audio=False` left out, one line each
    keys: int = 0

    @classmethod
    def load(cls, path: str | Path, *, audio: bool = True) -> "LoRA":
        """Read one file; `audio=False` leaves the DiT's audio branch out (`AUDIO_MODULES`, the AdaLN audio rows,
        the PDD audio head bank) and lists what it left out in `skipped`."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        from ..safetensors_header import HeaderError, header_length, parse_header

        path = Path(path)
        if path.suffix != ".safetensors":
            raise LoraError(f"{path.name}: LoRAs are read as .safetensors only (never pickle)")
        # Read, never memory-mapped: a LoRA is a file users download and replace, and a file truncated or rewritten
        # under a mapping would crash this process (SIGBUS) instead of failing this load.
        try:
            data = path.read_bytes()
            metadata = parse_header(data[8:8 + header_length(data[:8])]).metadata or {}
            raw = load_safetensors(data)
        except (SafetensorError, HeaderError, OSError) as error:
            raise LoraError(f"{path.name}: not a readable safetensors file ({error})") from None
        return cls.from_state_dict(raw, path.name, metadata, audio=audio)

    @classmethod
    def from_state_dict(cls, raw: dict, name: str, metadata: dict | None = None, *, audio: bool = True) -> "LoRA":
        parsed = parse(dict(raw), metadata or {}, name)
        factors, heads, skipped = dict(parsed.factors), dict(parsed.heads), []
        if not audio:
            for module in AUDIO_MODULES:
                if factors.pop(module, None) is not None:
                    skipped.append(f"{module} (LoRA)")
            if heads.pop("audio_proj_out", None) is not None:
                skipped.append("audio_proj_out (PDD head bank)")
            rows = 0
            for module, (down, up, scale) in list(factors.items()):
                if module.endswith(".adaln_proj.linear") and up.shape[0] % ADALN_MODALITIES == 0:
                    part = up.shape[0] // ADALN_MODALITIES
                    up = up.clone()
                    up[AUDIO_MODALITY * part:] = 0  # the audio modality's 6 x hidden modulation rows
                    factors[module] = (down, up, scale)
                    rows += 1
            if rows:
                skipped.append(f"the audio rows of {rows} adaln_proj.linear")
        if not factors and not parsed.interleaved_qkv and not heads:
            where = " outside its audio branch" if skipped else ""
            raise LoraError(f"{name}: no LoRA factors for the H3 DiT{where}")
        return cls(name, factors, parsed.format, parsed.interleaved_qkv, heads, tuple(skipped), parsed.keys)

    # --- binding to one DiT ---------------------------------------------------------------------------------------

    def resolved(self, transformer: torch.nn.Module) -> dict:
        """`factors` plus DiffSynth's fused qkv split with this DiT's head_dim."""
        if not self.interleaved_qkv:
            return self.factors
        head_dim = transformer.config.attention_head_dim
        factors = dict(self.factors)
        for attn, (down, up, scale) in self.interleaved_qkv.items():
            ordered = deinterleave_qkv(up, head_dim, self.name, f"{attn}.qkv")
            for proj, part in zip(("to_q", "to_k", "to_v"), ordered.chunk(3, dim=0)):
                factors[f"{attn}.{proj}"] = (down, part.contiguous(), scale)
        return factors

    def check(self, transformer: torch.nn.Module) -> None:
        """Every factor targets a Linear of this DiT with matching shapes (else the LoRA is for other weights)."""
        from ..weights.quant.linear import QuantLinear

        modules = dict(transformer.named_modules())
        for module, (down, up, _) in self.resolved(transformer).items():
            target = modules.get(module)
            if not isinstance(target, (torch.nn.Linear, QuantLinear)):
                raise LoraError(f"{self.name}: {module} is not a Linear of this H3 DiT")
            if down.shape[1] != target.in_features or up.shape[0] != target.out_features:
                raise LoraError(
                    f"{self.name}: {module} expects a LoRA of {target.in_features} -> {target.out_features}, got "
                    f"A {tuple(down.shape)} / B {tuple(up.shape)} (a LoRA for a pruned or other checkpoint?)"
                )
        for module in self.heads:
            self._bank(module, modules[module])

    def _bank(self, module: str, target) -> tuple[torch.Tensor, torch.Tensor | None]:
        kind, weight, bias = self.heads[module]
        out, inp = target.out_features, target.in_features
        if kind == "flat":
            if weight.ndim != 2 or weight.shape[0] % out or weight.shape[1] != inp:
                raise LoraError(f"{self.name}: {module} bank {tuple(weight.shape)} is not [N x {out}, {inp}]")
            weight = weight.reshape(-1, out, inp)
            bias = None if bias is None else bias.reshape(weight.shape[0], out)
        if tuple(weight.shape[1:]) != (out, inp) or (bias is not None and tuple(bias.shape) != (weight.shape[0], out)):
            raise LoraError(
                f"{self.name}: {module} head bank {tuple(weight.shape)} does not fit this DiT's {out} x {inp} head"
            )
        return weight, bias

    def describe(self) -> str:
        """One line for logs and reports: format, keys, modules changed, what was left out."""
        heads = ", ".join(f"{m} bank x{self.heads[m][1].shape[0]}" for m in self.heads)
        linears = len(self.factors) + 3 * len(self.interleaved_qkv)
        text = f"{self.name}: {self.format} format, {self.keys} tensors -> {linears} LoRA'd Linears"
        text += f", PDD heads: {heads}" if heads else ""
        return text + (f"; left out (audio): {'; '.join(self.skipped)}" if self.skipped else "")

    @contextlib.contextmanager
    def applied(self, transformer: torch.nn.Module, strength: float = 1.0, schedule: Schedule | None = None):
        """Run `transformer` with this LoRA at `strength` inside the block; exactly as before after it."""
        with LoRAStack(((self, 1.0),), schedule).applied(transformer, strength) as stack:
            yield stack


@dataclass(frozen=True)
class LoRAStack:
    """Several LoRAs, each at its own strength; quacks like a `LoRA` for `SamplingOptions.lora`."""

    entries: tuple  # ((LoRA, strength), ...)
    schedule: Schedule | None = None

    @property
    def name(self) -> str:
        return " + ".join(f"{lora.name}@{strength:g}" for lora, strength in self.entries)

    def check(self, transformer: torch.nn.Module) -> None:
        for lora, _ in self.entries:
            lora.check(transformer)
        if sum(1 for lora, _ in self.entries if lora.heads) > 1:
            raise LoraError(f"{self.name}: two PDD head banks cannot drive one output head")

    @contextlib.contextmanager
    def applied(self, transformer: torch.nn.Module, strength: float = 1.0):
        self.check(transformer)
        modules = dict(transformer.named_modules())
        handles = []
        try:
            for lora, own in self.entries:
                factor_strength = float(strength) * float(own)
                for module, (down, up, scale) in lora.resolved(transformer).items():
                    handles.append(_add_branch(modules[module], down, up, factor_strength * scale))
                if lora.heads:
                    handles.extend(_pdd_heads(lora, transformer, modules, factor_strength, self.schedule))
            yield self
        finally:
            for handle in handles:
                handle.remove()


def _add_branch(target, down, up, factor: float):
    from ..weights.quant.linear import QuantLinear

    if isinstance(target, QuantLinear):  # computed in the activation's dtype, beside the codes
        return target.add_lora(down.to(target.weight.device), up.to(target.weight.device), factor)
    down_d = down.to(target.weight.device, target.weight.dtype)
    up_d = up.to(target.weight.device, target.weight.dtype)

    # Under sequence parallelism the layer may run inside diffusers' context-parallel split / gather hooks: the
    # branch is computed on the input the layer's own forward saw and passed through the same hooks as its output.
    parallel = diffusers_adapter.context_parallel_hooks(target)

    def hook(mod, args, output, down_d=down_d, up_d=up_d, factor=factor):
        x = diffusers_adapter.as_the_layer_sees(parallel, mod, args, {})[0][0] if parallel else args[0]
        if down_d.device != x.device:  # a streamed layer (ComfyUI low VRAM): weights on the offload
            down_d, up_d = down_d.to(x.device), up_d.to(x.device)  # device, input on GPU
        branch = factor * torch.nn.functional.linear(torch.nn.functional.linear(x.to(down_d.dtype), down_d), up_d)
        if parallel:
            branch = diffusers_adapter.as_the_layer_returns(parallel, mod, branch)
        return output + branch.to(output.dtype)

    return target.register_forward_hook(hook)


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow shift of unshifted time u in [0, 1] (diffusers' static shift: s u / (1 + (s - 1) u))."""
    return shift * u / (1 + (shift - 1) * u)


def pdd_blend(bank: int, step: int, forwards: int, shift: float) -> torch.Tensor:
    """Weights [bank] of the heads one step uses: forward `step` of `forwards` spans grid points
    round(step N / forwards) .. round((step + 1) N / forwards) of the N-interval grid, each head weighted by its
    interval's length in shifted sigma (the step's mean velocity)."""
    start = min(round(step * bank / forwards), bank - 1)
    stop = max(round((step + 1) * bank / forwards), start + 1)
    sigmas = shifted(1 - torch.arange(bank + 1, dtype=torch.float64) / bank, shift)
    weights = torch.zeros(bank, dtype=torch.float64)
    weights[start:stop] = sigmas[start:stop] - sigmas[start + 1:stop + 1]
    return weights / weights.sum()


def _pdd_heads(lora: LoRA, transformer, modules: dict, strength: float, schedule: Schedule | None):
    if schedule is None:
        raise LoraError(
            f"{lora.name} is a PDD LoRA: its {len(lora.heads)} head bank(s) need the run's schedule (steps and "
            "shifts), which only a LoRA stack built for the run carries (the Sampler and `generate` build one)"
        )
    forwards = schedule.steps - 1
    state = {"step": 0}

    def count(module, args, kwargs):
        state["current"] = state["step"]
        state["step"] += 1

    handles = [transformer.register_forward_pre_hook(count, with_kwargs=True)]
    for module, stream in HEAD_MODULES.items():
        if module not in lora.heads:
            continue
        weight, bias = lora._bank(module, modules[module])
        shift = schedule.video_shift if stream == "video" else schedule.audio_shift
        if shift is None:  # the release's shifts
            shift = facts.VIDEO_SHIFT if stream == "video" else facts.AUDIO_SHIFT
        blends = [pdd_blend(weight.shape[0], k, forwards, shift) for k in range(forwards)]
        target = modules[module]
        parallel = diffusers_adapter.context_parallel_hooks(target)  # as in _add_branch

        def hook(mod, args, output, weight=weight, bias=bias, blends=blends, parallel=parallel):
            k = state.get("current", 0)
            if k >= len(blends):
                raise LoraError(f"{lora.name}: PDD heads were given {len(blends)} steps but the DiT ran a {k + 1}th")
            x = diffusers_adapter.as_the_layer_sees(parallel, mod, args, {})[0][0] if parallel else args[0]
            mix = blends[k].to(weight.dtype)
            w = torch.einsum("n,noi->oi", mix, weight).to(x.device, output.dtype)
            b = None if bias is None else (mix @ bias).to(x.device, output.dtype)
            bank_out = torch.nn.functional.linear(x.to(output.dtype), w, b)
            if parallel:
                bank_out = diffusers_adapter.as_the_layer_returns(parallel, mod, bank_out)
            return output + strength * (bank_out - output)

        handles.append(target.register_forward_hook(hook))
    return handles


def parse_spec(spec: str) -> tuple[str, float]:
    """`FILE[:STRENGTH]` (the CLI's repeatable --lora): a trailing `:number` is the strength, else 1."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def stack_for_run(specs, *, steps: int, video_shift: float | None = None, audio_shift: float | None = None,
                  audio: bool = True, log=None) -> LoRAStack | None:
    """The LoRAs of one run: `specs` = `FILE[:STRENGTH]` strings or (path, strength) pairs; None without any.
    The stack carries the run's schedule (a PDD head bank needs it); `log` gets one `describe()` line per LoRA."""
    entries = []
    for spec in specs:
        path, strength = parse_spec(spec) if isinstance(spec, str) else spec
        lora = LoRA.load(path, audio=audio)
        if log is not None:
            log(f"lora: {lora.describe()} at strength {strength:g}")
        entries.append((lora, float(strength)))
    if not entries:
        return None
    return LoRAStack(tuple(entries), Schedule(steps, video_shift, audio_shift))
