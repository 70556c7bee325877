"""The README's pictures: scripts/readme_assets.py renders them from an mp4, and README.md shows only files in the
repository (every relative link it makes resolves)."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from h3_core import media, testing

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "readme_assets.py"
MAX_PNG_BYTES = 150 * 1024
# Fixed by the script whatever the clip: 4 x 2 tiles 256 px wide, 4 px gaps; figures in inches x 100 dpi.
ARCHITECTURE_SIZE, WAVEFORM_SIZE = (1000, 420), (800, 300)


def render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def clip_mp4(tmp_path_factory) -> Path:
    """One second of the scrolling test card, 96x48 (2:1 like the demo), with a 220/330 Hz stereo soundtrack."""
    clip = testing.video(1.0, height=48, width=96)
    return Path(media.write_mp4(tmp_path_factory.mktemp("clip") / "clip.mp4", clip.frames, clip.audio, clip.fps,
                                clip.sample_rate))


@pytest.fixture(scope="module")
def rendered(clip_mp4, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("images")
    done = render("--mp4", str(clip_mp4), "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_pictures_exist_with_fixed_sizes_and_fit_a_readme(rendered):
    expected = {"architecture.png": ARCHITECTURE_SIZE, "demo_waveform.png": WAVEFORM_SIZE,
                # 96x48 frames -> 256x128 tiles: 4 * 256 + 5 * 4 wide, 2 * 128 + 3 * 4 high
                "demo_contact_sheet.png": (1044, 268)}
    assert sorted(p.name for p in rendered.iterdir()) == sorted(expected)
    for name, size in expected.items():
        with Image.open(rendered / name) as image:
            assert image.format == "PNG" and image.size == size, name
        assert (rendered / name).stat().st_size < MAX_PNG_BYTES, name


def test_contact_sheet_shows_evenly_spaced_frames_in_order(clip_mp4, rendered):
    frames = media.read_video(clip_mp4).frames  # 24 frames: tiles show 0, 3, 7, 10, 13, 16, 20, 23
    sheet = np.asarray(Image.open(rendered / "demo_contact_sheet.png").convert("RGB")).astype(np.int16)

    def tile(slot):  # the lower half, below the frame-number label
        x, y = 4 + (slot % 4) * 260, 4 + (slot // 4) * 132
        return sheet[y + 64 : y + 128, x : x + 256]

    def expected(index):
        big = Image.fromarray(frames[index]).resize((256, 128), Image.Resampling.NEAREST)
        return np.asarray(big).astype(np.int16)[64:128]

    for slot, index in ((0, 0), (1, 3), (4, 13), (7, 23)):
        own = np.abs(tile(slot) - expected(index)).mean()
        assert own < 4, (slot, index, own)  # lossless PNG, or at worst a 256-colour palette
        assert own < np.abs(tile(slot) - expected(23 - index)).mean(), (slot, index)  # not another frame
    # The gaps between tiles stay white: the grid is where the test above looks.
    assert (sheet[:, 260:264] == 255).all() and (sheet[132:136, :] == 255).all()


def test_noise_like_the_tiny_models_stays_under_the_budget(tmp_path):
    # The tiny model's frames are noise, which barely compresses: the sheet falls back to a 256-colour palette.
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (24, 64, 128, 3), dtype=np.uint8)
    clip = media.write_mp4(tmp_path / "noise.mp4", frames, testing.tone(1.0), 24)
    done = render("--mp4", clip, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    sheet = tmp_path / "demo_contact_sheet.png"
    assert sheet.stat().st_size < MAX_PNG_BYTES
    with Image.open(sheet) as image:
        assert image.mode == "P" and image.size == (1044, 268)
        pixels = np.asarray(image.convert("RGB")).astype(np.int16)
    decoded = media.read_video(clip).frames

    def enlarged(index):
        return np.asarray(Image.fromarray(decoded[index]).resize((256, 128), Image.Resampling.NEAREST)).astype(np.int16)

    own = np.abs(pixels[4 + 64 : 4 + 128, 4:260] - enlarged(0)[64:]).mean()
    assert own < 12 < np.abs(pixels[4 + 64 : 4 + 128, 4:260] - enlarged(23)[64:]).mean()  # frame 0, fewer colours


def test_waveform_draws_both_channels(rendered):
    pixels = np.asarray(Image.open(rendered / "demo_waveform.png").convert("RGB")).astype(np.int16)
    height = pixels.shape[0]

    def coloured(rgb):  # matplotlib's C0 (left) and C1 (right)
        return (np.abs(pixels - np.array(rgb)).sum(axis=-1) < 30).nonzero()[0]

    blue, orange = coloured((31, 119, 180)), coloured((255, 127, 14))
    # A 0.3-amplitude tone fills a band in each panel: left in the top half, right in the bottom half.
    assert len(blue) > 5000 and len(orange) > 5000
    assert np.median(blue) < height / 2 < np.median(orange)


def test_clear_errors_for_a_missing_or_silent_mp4(tmp_path):
    missing = render("--mp4", str(tmp_path / "none.mp4"), "--out", str(tmp_path / "a"))
    assert missing.returncode != 0 and "bash scripts/demo.sh" in missing.stderr
    silent = tmp_path / "silent.mp4"
    media.write_mp4(silent, testing.video(0.5, height=32, width=32, audio=False).frames)
    done = render("--mp4", str(silent), "--out", str(tmp_path / "b"))
    assert done.returncode != 0 and "no audio stream" in done.stderr


def test_skip_demo_draws_only_the_diagram(tmp_path):
    done = render("--skip-demo", "--mp4", str(tmp_path / "none.mp4"), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["architecture.png"]


# --- README.md ----------------------------------------------------------------------------------------------------

README = (REPO / "README.md").read_text(encoding="utf-8")
IMAGES = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", README) + re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"", README)
LINKS = [target for target in re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)", README) if "://" not in target]


def test_readme_shows_the_pictures_from_files_in_the_repository():
    assert {"docs/images/architecture.png", "docs/images/demo_contact_sheet.png", "docs/images/demo_waveform.png",
            "bench/results/split.png"} <= set(IMAGES)
    for target in IMAGES:
        assert "://" not in target, f"README.md shows a picture from outside the repository: {target}"
        path = REPO / target
        assert path.is_file(), f"README.md shows {target}, which is not in the repository"
        with Image.open(path) as image:
            image.verify()
        assert path.stat().st_size < MAX_PNG_BYTES, target


def test_readme_links_resolve():
    assert "docs/ARCHITECTURE.md" in LINKS and "docs/REAL_WEIGHTS.md" in LINKS
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens.
    anchors = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
               for heading in re.findall(r"^#+ (.+)$", README, flags=re.MULTILINE)}
    for target in LINKS:
        if target.startswith("#"):
            assert target[1:] in anchors, f"README.md links {target}, which is no heading of README.md"
        else:
            assert (REPO / target.split("#")[0]).exists(), f"README.md links {target}, which is not in the repository"


def test_committed_pictures_have_the_sizes_the_script_draws():
    # A stale or hand-edited picture shows up as another size; the demo's frames are 2:1 like the clip above.
    sizes = {"architecture.png": ARCHITECTURE_SIZE, "demo_waveform.png": WAVEFORM_SIZE,
             "demo_contact_sheet.png": (1044, 268)}
    for name, size in sizes.items():
        with Image.open(REPO / "docs" / "images" / name) as image:
            assert image.size == size, name
