"""LoRAs for the H3 DiT (Turbo distillations, style LoRAs), applied without touching the weights.

Files are read as safetensors only. diffusers' own converter (`MiniMaxH3LoraLoaderMixin.lora_state_dict`)
maps every published naming (Comfy/native fused `qkv_proj`, `mlp.fc1` with its halves swapped,
kohya `lora_down`/`lora_up` + `.alpha`, musubi-tuner, DiffSynth) onto diffusers' module names.

The low-rank update runs beside each targeted Linear as a forward hook, y = W x + s * B (A x), the
way an unmerged peft adapter computes it (peft itself is not needed). Nothing is written into the
weights, so leaving `applied(...)` restores the DiT exactly, and one loaded DiT serves requests with
and without the LoRA. A quantised layer (`QuantLinear`, from an int8 / fp8 / w6a8 file) gets the same
branch inside its forward (`QuantLinear.add_lora`): its codes are never re-quantised.
Turbo LoRAs change the schedule too: the Turbo LoRAs' cards ask for 5 or 9
sigma points and video shift 6 or 12 (`SamplingOptions` carries both).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "transformer."


class LoraError(ValueError):
    """A LoRA file that cannot apply to this DiT (unknown module, wrong shape, not safetensors)."""


@dataclass(frozen=True)
class LoRA:
    name: str
    factors: dict  # module path -> (A [rank, in], B [out, rank], scale)

    @classmethod
    def load(cls, path: str | Path) -> "LoRA":
        from diffusers.loaders import MiniMaxH3LoraLoaderMixin
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        from .safetensors_header import HeaderError, header_length, parse_header

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
        already_diffusers = all(key.startswith(PREFIX) for key in raw)
        try:
            converted = MiniMaxH3LoraLoaderMixin.lora_state_dict(raw)
        except (ValueError, KeyError) as error:
            raise LoraError(f"{path.name}: not an H3 DiT LoRA ({error})") from None
        state = converted[0] if isinstance(converted, tuple) else converted
        # Converted files have `.alpha` folded in; a diffusers-named file may state its alpha in the metadata.
        alpha = _metadata_alpha(metadata) if already_diffusers else None
        factors = {}
        for key, down in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = (
                key[len(PREFIX) : -len(".lora_A.weight")] if key.startswith(PREFIX) else key[: -len(".lora_A.weight")]
            )
            up = state.get(key.replace(".lora_A.weight", ".lora_B.weight"))
            if up is None:
                raise LoraError(f"{path.name}: {module} has lora_A but no lora_B")
            scale = alpha / down.shape[0] if alpha is not None else 1.0
            factors[module] = (down.float(), up.float(), scale)
        if not factors:
            raise LoraError(f"{path.name}: no LoRA factors for the H3 DiT")
        return cls(path.name, factors)

    def check(self, transformer: torch.nn.Module) -> None:
        """Every factor targets a Linear of this DiT with matching shapes (else the LoRA is for other weights)."""
        from .weights.quant.linear import QuantLinear

        modules = dict(transformer.named_modules())
        for module, (down, up, _) in self.factors.items():
            target = modules.get(module)
            if not isinstance(target, (torch.nn.Linear, QuantLinear)):
                raise LoraError(f"{self.name}: {module} is not a Linear of this H3 DiT")
            if (
                down.shape[1] != target.in_features
                or up.shape[0] != target.out_features
                or up.shape[1] != down.shape[0]
            ):
                raise LoraError(
                    f"{self.name}: {module} expects a LoRA of {target.in_features} -> {target.out_features}, got "
                    f"A {tuple(down.shape)} / B {tuple(up.shape)} (a LoRA for a pruned or other checkpoint?)"
                )

    @contextlib.contextmanager
    def applied(self, transformer: torch.nn.Module, strength: float = 1.0):
        """Run `transformer` with this LoRA at `strength` inside the block; exactly as before after it."""
        from .weights.quant.linear import QuantLinear

        self.check(transformer)
        modules = dict(transformer.named_modules())
        handles = []
        try:
            for module, (down, up, scale) in self.factors.items():
                target = modules[module]
                factor = float(strength) * scale
                if isinstance(target, QuantLinear):  # computed in the activation's dtype, beside the codes
                    handles.append(target.add_lora(down.to(target.weight.device), up.to(target.weight.device), factor))
                    continue
                down_d = down.to(target.weight.device, target.weight.dtype)
                up_d = up.to(target.weight.device, target.weight.dtype)

                def hook(mod, args, output, down_d=down_d, up_d=up_d, factor=factor):
                    if down_d.device != args[0].device:  # a streamed layer (ComfyUI low VRAM): weights on the offload
                        down_d, up_d = down_d.to(args[0].device), up_d.to(args[0].device)  # device, input on GPU
                    return output + factor * torch.nn.functional.linear(
                        torch.nn.functional.linear(args[0].to(down_d.dtype), down_d), up_d
                    ).to(output.dtype)

                handles.append(target.register_forward_hook(hook))
            yield self
        finally:
            for handle in handles:
                handle.remove()


def _metadata_alpha(metadata: dict) -> float | None:
    for key in ("alpha", "lora_alpha", "ss_network_alpha"):
        if key in metadata:
            try:
                return float(json.loads(metadata[key]))
            except (TypeError, ValueError):
                return None
    return None
