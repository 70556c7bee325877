"""Assemble a component config from defaults, stated hints and tensor shapes.

Precedence: the release config (`h3_core.configs`) supplies every value; a config stated by the
checkpoint (diffusers `config.json`, a native config, or the `h3.config` metadata this package
writes) overrides it; values read off tensor shapes must then agree with what was stated. Shapes
are facts about the weights, so a disagreement is an error rather than a silent override.
"""

from __future__ import annotations

import json

from .errors import H3WeightsError

# safetensors `__metadata__` key under which this package's writers record the full config. It is
# what makes values that shapes cannot reveal (attention head split of a fused QKV, GroupNorm
# groups, audio-attention heads...) survive a Comfy-layout round trip of a non-release (tiny) model.
CONFIG_METADATA_KEY = "h3.config"
COMPONENT_METADATA_KEY = "h3.component"


def _normalise(value):
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


# Sub-configs stated by one file of a multi-file checkpoint (`h3.config.text_config`: a llama.cpp GGUF language
# file states the text config, its vision file the vision config; `gguf_file`). `h3.config` itself wins.
PART_METADATA_KEYS = tuple(f"{CONFIG_METADATA_KEY}.{part}" for part in ("text_config", "vision_config"))


def _json_object(metadata: dict[str, str], key: str) -> dict:
    try:
        config = json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise H3WeightsError(f"safetensors metadata {key!r} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise H3WeightsError(f"safetensors metadata {key!r} is not a JSON object")
    return config


def metadata_config(metadata: dict[str, str]) -> dict:
    config = _json_object(metadata, CONFIG_METADATA_KEY) if metadata.get(CONFIG_METADATA_KEY) else {}
    for key in PART_METADATA_KEYS:
        if metadata.get(key):
            part = key[len(CONFIG_METADATA_KEY) + 1:]
            config[part] = {**_json_object(metadata, key), **config.get(part, {})}
    return config


def merge(defaults: dict, stated: dict, derived: dict, source: str) -> dict:
    """defaults <- stated (known keys only) <- derived (must agree with stated)."""
    config = _normalise(dict(defaults))
    for key, value in (stated or {}).items():
        if key in config:
            config[key] = _normalise(value)
    for key, value in derived.items():
        value = _normalise(value)
        if key in (stated or {}) and _normalise(stated[key]) != value:
            raise H3WeightsError(
                f"{source}: the stated config has {key}={stated[key]!r} but the tensor shapes say {key}={value!r}"
            )
        config[key] = value
    return config


def config_metadata(component: str, config: dict) -> dict[str, str]:
    """The fixed metadata every writer stores (sorted JSON, so bytes are reproducible)."""
    return {
        "format": "pt",
        COMPONENT_METADATA_KEY: component,
        CONFIG_METADATA_KEY: json.dumps(_normalise(config), sort_keys=True, separators=(",", ":")),
    }
