"""LoRAs from the trainers users use, on the tiny H3: every key format lands exactly where its trainer's key map says,
nothing is dropped silently, the audio branch can be left out, LoRAs stack, and PDD head banks drive the output heads.

References: the module map of each native / musubi-tuner / kohya / ai-toolkit / Comfy-Org file is checked against
diffusers' own converter (`MiniMaxH3LoraLoaderMixin.lora_state_dict`, whose docstring names each producer's layout),
DiffSynth-Studio's interleaved qkv against the same converter on a released-width (128) head, and diffusers-named files
against the DiT's own module names. The PDD head bank is checked against an independent implementation of ComfyUI's
(PR #15908: heads spanned by the step from sigma to the sampler's next sigma, mean weighted by each interval's length).
"""

import copy

import pytest
import torch
from safetensors.torch import save_file
from support import lora_support as writers

from h3_core.diffusion import DiffusionStage, SamplingOptions
from h3_core.encoder import EncoderStage
from h3_core.lora import LoRA, LoraError, LoRAStack, Schedule, parse_spec, pdd_blend, shifted, stack_for_run
from h3_core.models import ModelSource
from h3_core.testing import CASES, STEPS


@pytest.fixture(scope="module", autouse=True)
def _parity_threads(parity_threads):
    """Bitwise comparisons: the thread count is pinned (conftest.parity_threads)."""


@pytest.fixture(scope="module")
def setup(tiny_dir):
    source = ModelSource.from_path(tiny_dir)
    request = CASES["t2va-64x64-seed0"][0]
    return source, EncoderStage(source, ("text",)).encode(request), DiffusionStage(source)


def _linears(transformer):
    return {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


def _probe(transformer, lora, strength=1.0):
    """Each Linear's output change under `lora`, as the delta weight it realises: {module: dW} (zeros included)."""
    linears = _linears(transformer)
    inputs = {name: torch.eye(m.in_features) for name, m in linears.items()}  # x = I: y - y0 = dW^T
    with torch.no_grad():
        base = {name: linears[name](inputs[name]) for name in linears}
        with lora.applied(transformer, strength):
            changed = {name: linears[name](inputs[name]) for name in linears}
    return {name: (changed[name] - base[name]).T for name in linears}


def _reference_deltas(raw):
    """diffusers' converter (the trainers' key maps, alpha folded): {diffusers module: B @ A}."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    state = MiniMaxH3LoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in raw.items()})
    deltas = {}
    for key, down in state.items():
        if key.endswith(".lora_A.weight"):
            module = key[len("transformer."): -len(".lora_A.weight")]
            deltas[module] = state[key.replace(".lora_A.", ".lora_B.")].float() @ down.float()
    return deltas


def _assert_exact_map(transformer, lora, expected, strength=1.0):
    got = _probe(transformer, lora, strength)
    changed = {name for name, delta in got.items() if delta.abs().max() > 0}
    assert changed == set(expected), (sorted(changed ^ set(expected)))
    for name, delta in expected.items():
        assert torch.allclose(got[name], strength * delta, atol=2e-6, rtol=1e-4), name


NATIVE_CASES = {
    # name: (writer kwargs) — the trainer / publisher whose naming it is
    "comfy-org turbo (diffusion_model., lora_A/B, .alpha)": dict(prefix="diffusion_model.", alpha=8.0),
    "ai-toolkit (diffusion_model., lora_A/B, no alpha)": dict(prefix="diffusion_model."),
    "reference generate.py (bare, kohya lora_down/up, .alpha)": dict(prefix="", kohya=True, alpha=2.0),
}


@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
def test_native_formats_follow_the_reference_key_map(setup, tmp_path, case):
    transformer = setup[2].transformer("t2va")
    raw = writers.native_lora(tmp_path / "l.safetensors", transformer, **NATIVE_CASES[case])
    lora = LoRA.load(tmp_path / "l.safetensors")
    assert lora.format == "native" and lora.keys == len(raw)
    expected = _reference_deltas(raw)
    assert len(expected) == len(_linears(transformer))  # every LoRA-able Linear, none left behind
    _assert_exact_map(transformer, lora, expected, strength=0.8)


def test_musubi_tuner_flattened_names(setup, tmp_path):
    transformer = setup[2].transformer("t2va")
    raw = writers.musubi_lora(tmp_path / "m.safetensors", transformer, alpha=2.0)
    lora = LoRA.load(tmp_path / "m.safetensors")
    assert lora.format == "musubi"
    _assert_exact_map(transformer, lora, _reference_deltas(raw))


def test_diffsynth_interleaved_qkv(setup, tmp_path):
    """DiffSynth's fused qkv is interleaved per head; split with the DiT's own head_dim it equals the [q; k; v] file."""
    transformer = setup[2].transformer("t2va")
    _, ordered = writers.diffsynth_lora(tmp_path / "d.safetensors", transformer)
    lora = LoRA.load(tmp_path / "d.safetensors")
    assert lora.format == "diffsynth" and lora.interleaved_qkv
    plain = {f"{name}.lora_A.weight": a for name, (a, _) in ordered.items()}
    plain.update({f"{name}.lora_B.weight": b for name, (_, b) in ordered.items()})
    _assert_exact_map(transformer, lora, _reference_deltas(plain))


def test_diffsynth_deinterleave_matches_diffusers_on_a_released_head():
    """diffusers' converter de-interleaves for the released 128-wide heads only; the same rows come out here."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 16, generator=g), torch.randn(3 * 2 * 128, 4, generator=g)
    raw = {"blocks.0.attn.qkv_proj.lora_A.default.weight": a, "blocks.0.attn.qkv_proj.lora_B.default.weight": b}
    expected = _reference_deltas(raw)
    lora = LoRA.from_state_dict(raw, "diffsynth")

    class Config:
        attention_head_dim = 128

    fake = torch.nn.Module()
    fake.config = Config()
    got = {m: up @ down * scale for m, (down, up, scale) in lora.resolved(fake).items()}
    assert set(got) == set(expected)
    for module in got:
        assert torch.allclose(got[module], expected[module], atol=1e-6)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_diffusers_names_and_metadata_alpha(setup, tmp_path, prefix):
    """diffusers' own names (save_lora_weights, prefixless peft / PDD trunks, kohya down/up on them): identity map;
    a `__metadata__` alpha scales every module by alpha / rank (lightx2v Turbo files)."""
    transformer = setup[2].transformer("t2va")
    raw = writers.diffusers_lora(tmp_path / "f.safetensors", transformer, prefix=prefix, kohya=not prefix,
                                 metadata={"alpha": "2"})
    lora = LoRA.load(tmp_path / "f.safetensors")
    assert lora.format == "diffusers"
    down, up = (".lora_down.weight", ".lora_up.weight") if not prefix else (".lora_A.weight", ".lora_B.weight")
    expected = {name: raw[f"{prefix}{name}{up}"] @ raw[f"{prefix}{name}{down}"] * (2 / writers.RANK)
                for name in _linears(transformer)}
    _assert_exact_map(transformer, lora, expected)


@pytest.mark.parametrize("extra, message", [
    ({"diffusion_model.blocks.0.mlp.fc2.diff": torch.zeros(64, 128)}, "blocks.0.mlp.fc2.diff"),
    ({"diffusion_model.blocks.0.mlp.fc2.dora_scale": torch.ones(1, 128)}, "dora_scale"),
    ({"diffusion_model.blocks.0.mlp.fc2.weight": torch.zeros(64, 128)}, "blocks.0.mlp.fc2.weight"),
    ({"diffusion_model.blocks.0.mlp.fc2.lora_B.bias": torch.zeros(64)}, "lora_B.bias"),
])
def test_unplaceable_tensors_are_errors_naming_them(setup, tmp_path, extra, message):
    transformer = setup[2].transformer("t2va")
    raw = writers.native_lora(tmp_path / "l.safetensors", transformer)
    save_file({**raw, **extra}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(LoraError, match=message.replace(".", r"\.")):
        LoRA.load(tmp_path / "bad.safetensors")


def test_half_pairs_and_unknown_modules_are_errors(setup, tmp_path):
    transformer = setup[2].transformer("t2va")
    raw = writers.native_lora(tmp_path / "l.safetensors", transformer)
    cases = [
        ({k: v for k, v in raw.items() if k != "diffusion_model.blocks.1.mlp.fc2.lora_A.weight"},
         "blocks.1.mlp.fc2 has .*not both"),
        ({"diffusion_model.blocks.0.attn.nope.lora_A.weight": torch.zeros(4, 64),
          "diffusion_model.blocks.0.attn.nope.lora_B.weight": torch.zeros(64, 4)}, "blocks.0.attn.nope is not"),
        ({"lora_unet_blocks_0_attn_nope.lora_down.weight": torch.zeros(4, 64),
          "lora_unet_blocks_0_attn_nope.lora_up.weight": torch.zeros(64, 4)}, "lora_unet_blocks_0_attn_nope"),
        ({"transformer.transformer_blocks.0.attn.nope.lora_A.weight": torch.zeros(4, 64),
          "transformer.transformer_blocks.0.attn.nope.lora_B.weight": torch.zeros(64, 4)}, "not a Linear"),
    ]
    for index, (tensors, message) in enumerate(cases):
        save_file(tensors, str(tmp_path / f"bad{index}.safetensors"))
        with pytest.raises(LoraError, match=message):
            LoRA.load(tmp_path / f"bad{index}.safetensors").check(transformer)


def test_audio_branch_left_out(setup, tmp_path):
    """audio=False: no update on audio_proj_in / audio_proj_out and none on the AdaLN rows of the audio modality;
    every other module changes exactly as with the audio kept. A LoRA on the audio branch alone then samples bitwise
    the base model."""
    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    raw = writers.native_lora(tmp_path / "l.safetensors", transformer, alpha=4.0)
    full = _reference_deltas(raw)
    lora = LoRA.load(tmp_path / "l.safetensors", audio=False)
    assert "audio_proj_in (LoRA)" in lora.skipped and "audio_proj_out (LoRA)" in lora.skipped
    expected = {m: d for m, d in full.items() if m not in ("audio_proj_in", "audio_proj_out")}
    hidden = transformer.config.hidden_size
    for module in expected:
        if module.endswith("adaln_proj.linear") and module.startswith("transformer_blocks."):
            expected[module] = expected[module].clone()
            expected[module][2 * 6 * hidden:] = 0  # rows of modality 2 (audio): [video | text | audio] x 6 x hidden
    _assert_exact_map(transformer, lora, expected)

    audio_only = {k: v for k, v in raw.items() if "audio_" in k}
    save_file(audio_only, str(tmp_path / "audio.safetensors"))
    with pytest.raises(LoraError, match="outside its audio branch"):
        LoRA.load(tmp_path / "audio.safetensors", audio=False)


def test_stacked_loras_add_at_their_strengths_and_equal_merged_weights(setup, tmp_path):
    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    writers.musubi_lora(tmp_path / "a.safetensors", transformer, seed=1)
    writers.diffusers_lora(tmp_path / "b.safetensors", transformer, seed=2)
    stack = stack_for_run([f"{tmp_path / 'a.safetensors'}:0.5", (tmp_path / "b.safetensors", -1.25)], steps=STEPS)
    one, two = (lora for lora, _ in stack.entries)
    expected = {}
    for lora, strength in ((one, 0.5), (two, -1.25)):
        for module, (down, up, scale) in lora.factors.items():
            expected[module] = expected.get(module, 0) + strength * scale * (up @ down)
    _assert_exact_map(transformer, stack, expected)

    merged = copy.deepcopy(transformer)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for module, delta in expected.items():
            modules[module].weight += 0.9 * delta
    reference = DiffusionStage(modules={"transformer": merged}, pipeline_config=source.pipeline_config)
    want = reference.sample(cond, SamplingOptions(steps=STEPS, seed=2))
    got = stage.sample(cond, SamplingOptions(steps=STEPS, seed=2, lora=stack, lora_strength=0.9))
    assert (got.video - want.video).abs().max() < 1e-4 and (got.audio - want.audio).abs().max() < 1e-4
    after = stage.sample(cond, SamplingOptions(steps=STEPS, seed=2))
    base = reference.sample(cond, SamplingOptions(steps=STEPS, seed=2))
    assert not torch.equal(after.video, base.video)  # the merged copy differs; the live DiT was left untouched
    assert stack_for_run([], steps=STEPS) is None


def test_lora_specs():
    assert parse_spec("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert parse_spec("a.safetensors:-1") == ("a.safetensors", -1.0)
    assert parse_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert parse_spec(r"C:\loras\a.safetensors") == (r"C:\loras\a.safetensors", 1.0)
    assert parse_spec("d:with:colons/a.safetensors") == ("d:with:colons/a.safetensors", 1.0)


def test_pdd_blend_spans_the_steps_grid():
    """8 forwards over a 32-head grid: step k uses heads 4k..4k+3, weighted by their shifted-sigma interval."""
    for k in range(8):
        weights = pdd_blend(32, k, 8, 12.0)
        assert torch.nonzero(weights).flatten().tolist() == list(range(4 * k, 4 * k + 4))
        sigmas = shifted(1 - torch.arange(33, dtype=torch.float64) / 32, 12.0)
        span = sigmas[4 * k: 4 * k + 4] - sigmas[4 * k + 1: 4 * k + 5]
        assert torch.allclose(weights[4 * k: 4 * k + 4], span / span.sum())
    assert pdd_blend(32, 0, 4, 3.0).nonzero().flatten().tolist() == list(range(8))


@pytest.mark.parametrize("comfy", [False, True], ids=["alibaba-pai", "comfy-converted"])
def test_pdd_head_bank_drives_the_heads_as_comfyui_does(setup, tmp_path, comfy):
    """A PDD file's trunk is a LoRA on diffusers names; its banks replace proj_out / audio_proj_out per step. The
    reference: a merged trunk and heads computed ComfyUI's way from the sampler's own sigmas (read off the DiT's
    timestep input: t = 1 - sigma), video on shift 12, audio on shift 3."""
    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    steps, bank = 9, 32
    raw = writers.pdd_lora(tmp_path / "pdd.safetensors", transformer, bank=bank, comfy=comfy)
    lora = LoRA.load(tmp_path / "pdd.safetensors")
    assert set(lora.heads) == {"proj_out", "audio_proj_out"}
    assert lora.keys == len(raw)
    with pytest.raises(LoraError, match="need the run's schedule"):
        stage.sample(cond, SamplingOptions(steps=steps, seed=4, lora=lora))
    stack = LoRAStack(((lora, 1.0),), Schedule(steps, 12.0, 3.0))

    recorded = []  # the sampler's sigmas, read off the DiT's timestep input of a plain run
    handle = transformer.register_forward_pre_hook(
        lambda m, a, k: recorded.append(1.0 - k["timestep"].min().item()), with_kwargs=True)
    try:
        base = stage.sample(cond, SamplingOptions(steps=steps, seed=4))
    finally:
        handle.remove()
    sigmas = recorded + [0.0]

    merged = copy.deepcopy(transformer)
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for module, (down, up, scale) in lora.factors.items():
            modules[module].weight += scale * (up @ down)
    banks = {}
    for head, native in (("proj_out", "video_out"), ("audio_proj_out", "audio_out")):
        out, inp = modules[head].out_features, modules[head].in_features
        if comfy:
            weight = raw[f"diffusion_model.final_layer.{native}.set_weight"].reshape(bank, out, inp)
            bias = raw[f"diffusion_model.final_layer.{native}.set_bias"].reshape(bank, out)
        else:
            weight, bias = raw[f"{head}.weight"], raw[f"{head}.bias"]
        banks[head] = (weight, bias)
    forward = {"k": -1}
    merged.register_forward_pre_hook(lambda m, a, k: forward.update(k=forward["k"] + 1), with_kwargs=True)

    def comfy_head(head, shift):
        def hook(mod, args, output):
            sigma, sigma_next = sigmas[forward["k"]], sigmas[forward["k"] + 1]
            unshift = lambda s: s / (12.0 - 11.0 * s)  # noqa: E731  inverse of the video shift 12
            start = min(round((1 - unshift(sigma)) * bank), bank - 1)
            stop = max(round((1 - unshift(sigma_next)) * bank), start + 1)
            grid = shifted(1 - torch.arange(bank + 1, dtype=torch.float64) / bank, shift)
            weights = grid[start:stop] - grid[start + 1: stop + 1]
            weights = (weights / weights.sum()).float()
            weight, bias = banks[head]
            return torch.nn.functional.linear(args[0], torch.einsum("n,noi->oi", weights, weight[start:stop]),
                                              weights @ bias[start:stop]).to(output.dtype)
        return hook

    modules["proj_out"].register_forward_hook(comfy_head("proj_out", 12.0))
    modules["audio_proj_out"].register_forward_hook(comfy_head("audio_proj_out", 3.0))
    reference = DiffusionStage(modules={"transformer": merged}, pipeline_config=source.pipeline_config)
    want = reference.sample(cond, SamplingOptions(steps=steps, seed=4))
    got = stage.sample(cond, SamplingOptions(steps=steps, seed=4, lora=stack))
    assert len(recorded) == steps - 1 and forward["k"] == steps - 2
    assert (got.video - want.video).abs().max() < 1e-4 and (got.audio - want.audio).abs().max() < 1e-4
    assert not torch.equal(got.video, base.video) and not torch.equal(got.audio, base.audio)

    # audio left out: the audio head bank is not used (reported), the video bank still is
    quiet = LoRA.load(tmp_path / "pdd.safetensors", audio=False)
    assert set(quiet.heads) == {"proj_out"} and "audio_proj_out (PDD head bank)" in quiet.skipped


CORE_CASES = {
    "comfy-org turbo": (writers.native_lora, dict(prefix="diffusion_model.", alpha=8.0)),
    "ai-toolkit": (writers.native_lora, dict(prefix="diffusion_model.")),
    "kohya down/up": (writers.native_lora, dict(prefix="diffusion_model.", kohya=True, alpha=2.0)),
    "musubi-tuner": (writers.musubi_lora, dict(alpha=2.0)),
}


@pytest.mark.parametrize("case", sorted(CORE_CASES))
def test_formats_core_loads_change_what_core_changes(setup, tmp_path, case, tiny_dir):
    """ComfyUI core 0.33 as the reference, for the namings it reads (its generic `diffusion_model.` / `lora_unet_`
    key map over its own H3 module names): core merges the file into the tiny Comfy-format DiT; its weight deltas,
    taken to diffusers' names by the pack's weight converter (qkv split, fc1 halves swapped), are what the LoRA
    changes here, module for module, and core leaves no key of the file unloaded."""
    from support.comfy_harness import CORE_033, unavailable

    from h3_core.weights.transformer_keys import to_diffusers

    ok, why = CORE_033.available()
    if not ok:
        unavailable(why)
    transformer = setup[2].transformer("t2va")
    writer, kwargs = CORE_CASES[case]
    writer(tmp_path / "l.safetensors", transformer, **kwargs)
    dit_file = next((tiny_dir / "comfyui" / "diffusion_models").glob("*_fl2va_fp32.safetensors"))
    core, not_loaded = writers.core033_deltas(CORE_033.dir, CORE_033.site, dit_file, tmp_path / "l.safetensors",
                                              tmp_path / "core.safetensors")
    assert not_loaded == []
    converted, unexpected = to_diffusers(core, dict(transformer.config), "comfy")
    assert unexpected == []
    expected = {key[: -len(".weight")]: delta for key, delta in converted.items()}
    _assert_exact_map(transformer, LoRA.load(tmp_path / "l.safetensors"), expected)


def test_generate_stacks_repeated_lora_flags(setup, tmp_path, tiny_dir, capsys):
    """`generate --lora A:0.5 --lora B --lora-strength 0.8` samples what the stack (A at 0.4, B at 0.8) samples."""
    from safetensors.torch import load_file

    from h3_core import cli

    source, cond, stage = setup
    transformer = stage.transformer("t2va")
    writers.musubi_lora(tmp_path / "a.safetensors", transformer, seed=7)
    writers.native_lora(tmp_path / "b.safetensors", transformer, prefix="", kohya=True, alpha=2.0, seed=8)
    cond.save(tmp_path / "cond.safetensors")
    code = cli.main(["generate", "--models", str(tiny_dir / "diffusers"), "--cond", str(tmp_path / "cond.safetensors"),
                     "--steps", str(STEPS), "--seed", "3", "--out", str(tmp_path / "o.mp4"),
                     "--dump", str(tmp_path / "dump.safetensors"), "--lora", f"{tmp_path / 'a.safetensors'}:0.5",
                     "--lora", str(tmp_path / "b.safetensors"), "--lora-strength", "0.8"])
    assert code == 0
    log = capsys.readouterr().err
    assert "lora: a.safetensors: musubi format" in log and "lora: b.safetensors: native format" in log
    stack = stack_for_run([(tmp_path / "a.safetensors", 0.5), (tmp_path / "b.safetensors", 1.0)], steps=STEPS)
    want = stage.sample(cond, SamplingOptions(steps=STEPS, seed=3, lora=stack, lora_strength=0.8))
    dumped = load_file(str(tmp_path / "dump.safetensors"))
    assert torch.equal(dumped["latents"], want.video) and torch.equal(dumped["audio_latents"], want.audio)
