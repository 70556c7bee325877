"""Render the README's pictures into docs/images/, so they refresh with the code instead of being hand drawn.

    python scripts/readme_assets.py [--mp4 output/demo/h3_demo_ref2va_remote.mp4] [--out docs/images]

* ``architecture.png``: the pipeline's two paths to one CONDITIONING (local encoder nodes, or the remote encoder
  endpoint on another machine), then Sampler and Decode;
* ``demo_contact_sheet.png``: evenly spaced frames of the demo's mp4 (``bash scripts/demo.sh``), numbered;
* ``demo_waveform.png``: both channels of the demo's soundtrack over time (a min/max envelope per pixel column).

The mp4 is decoded with :mod:`h3_core.media` (PyAV), the sheet is drawn with Pillow and the plots with matplotlib
(a development requirement). Pass ``--skip-demo`` to redraw only the diagram. Every size is fixed, so the pictures
have the same pixel dimensions whatever the clip's resolution or length.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make the pack's h3_core importable
    sys.path.insert(0, str(REPO))

from h3_core import media  # noqa: E402

DEFAULT_MP4 = REPO / "output" / "demo" / "h3_demo_ref2va_remote.mp4"
DEFAULT_OUT = REPO / "docs" / "images"

# The contact sheet: COLUMNS x ROWS tiles, each TILE_WIDTH wide (height keeps the clip's aspect), GAP px apart.
COLUMNS, ROWS, TILE_WIDTH, GAP = 4, 2, 256, 4
MAX_SHEET_BYTES = 150 * 1024  # above this, the sheet is saved with a 256-colour palette
# The matplotlib figures, in inches at DPI (pixel size = inches * DPI; no tight bbox, so sizes never drift).
DPI = 100
WAVEFORM_INCHES = (8.0, 3.0)
ARCHITECTURE_INCHES = (10.0, 4.2)
# PNG metadata would otherwise carry matplotlib's version: leave it out so a rerun only changes what changed.
PNG_METADATA = {"Software": None}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sheet_size(width: int, height: int) -> tuple[int, int]:
    """The contact sheet's (width, height) in pixels for frames of ``width`` x ``height``."""
    tile_height = max(1, round(TILE_WIDTH * height / width))
    return COLUMNS * TILE_WIDTH + (COLUMNS + 1) * GAP, ROWS * tile_height + (ROWS + 1) * GAP


def contact_sheet(clip: media.VideoClip, path: Path) -> Path:
    """Evenly spaced frames (first and last included) in a grid, each labelled with its index and time."""
    count = min(COLUMNS * ROWS, clip.num_frames)
    picks = np.linspace(0, clip.num_frames - 1, count).round().astype(int)
    tile_height = max(1, round(TILE_WIDTH * clip.height / clip.width))
    # Small frames are enlarged without smoothing (each pixel stays a visible block); large ones are averaged down.
    resample = Image.Resampling.NEAREST if clip.width <= TILE_WIDTH else Image.Resampling.BOX
    sheet = Image.new("RGB", sheet_size(clip.width, clip.height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for slot, index in enumerate(picks):
        x = GAP + (slot % COLUMNS) * (TILE_WIDTH + GAP)
        y = GAP + (slot // COLUMNS) * (tile_height + GAP)
        tile = Image.fromarray(clip.frames[index]).resize((TILE_WIDTH, tile_height), resample)
        sheet.paste(tile, (x, y))
        label = f"frame {index}  {index / clip.fps:.2f} s"
        left, top, right, bottom = draw.textbbox((x + 4, y + 3), label, font=font)
        draw.rectangle((left - 3, top - 2, right + 3, bottom + 2), fill=(0, 0, 0))
        draw.text((x + 4, y + 3), label, fill=(255, 255, 255), font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path, optimize=True)
    if path.stat().st_size > MAX_SHEET_BYTES:
        # Noise (the tiny model's output) barely compresses in 24-bit colour; 256 colours keep it in a README budget.
        sheet.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    return path


def _envelope(channel: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin minimum and maximum: what a waveform looks like at one bin per pixel column."""
    usable = len(channel) - len(channel) % bins
    if usable == 0:  # shorter than the bins: plot the samples themselves
        return channel, channel
    blocks = channel[:usable].reshape(bins, -1)
    return blocks.min(axis=1), blocks.max(axis=1)


def waveform(clip: media.VideoClip, path: Path) -> Path:
    """Both channels of the soundtrack over time (mono is drawn twice, as the mp4 writer duplicates it)."""
    if clip.audio is None:
        raise SystemExit("the mp4 has no audio stream: nothing to draw for demo_waveform.png")
    plt = _pyplot()
    audio = clip.audio if clip.audio.shape[0] > 1 else np.repeat(clip.audio, 2, axis=0)
    # AAC decodes whole 1024-sample frames: drop the padding past the video's end (the length the mp4 writer wrote).
    audio = audio[:, : int(round(clip.num_frames / clip.fps * clip.sample_rate))]
    seconds = audio.shape[1] / clip.sample_rate
    bins = int(WAVEFORM_INCHES[0] * DPI)
    fig, axes = plt.subplots(2, 1, figsize=WAVEFORM_INCHES, dpi=DPI, sharex=True)
    for n, (ax, name) in enumerate(zip(axes, ("left", "right"))):
        low, high = _envelope(audio[n], bins)
        t = np.linspace(0.0, seconds, len(low))
        ax.fill_between(t, low, high, color=f"C{n}", linewidth=0.5)
        ax.set_ylim(-1.0, 1.0)
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"soundtrack: {clip.sample_rate} Hz stereo, {seconds:.2f} s", fontsize=9)
    axes[1].set_xlabel("seconds", fontsize=8)
    axes[1].set_xlim(0.0, seconds)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.16, hspace=0.12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return path


# The diagram, in axis units (100 x 42, 10 px each). Every box: (key, centre x, centre y, width, text, colour).
_ENCODER, _CONTRACT, _DIFFUSION, _MEDIA = "#dbe9f6", "#fde9c8", "#dff0d8", "#eeeeee"
_BOXES = [
    ("media", 7, 21, 11, "media\nprompt, keyframes,\nreference images,\nvideos, audio", _MEDIA),
    ("text", 25, 31, 14, "H3 Text Encode\nQwen3-VL", _ENCODER),
    ("video", 42, 31, 15, "H3 Video VAE Encode\nkeyframes, refs", _ENCODER),
    ("audio", 59, 31, 15, "H3 Audio VAE Encode\nsoundtracks, audio", _ENCODER),
    ("remote", 25, 10, 14, "H3 Remote Encode\nHTTP client", _ENCODER),
    ("server", 52.5, 10, 24, "encoder server\npython -m h3_core serve\ntext encoder + both VAE encoders", _ENCODER),
    ("cond", 73, 21, 11, "CONDITIONING\nH3Conditioning\n(safetensors)", _CONTRACT),
    ("sampler", 86.5, 28, 11, "H3 Sampler\nDiT", _DIFFUSION),
    ("decode", 86.5, 12, 11, "H3 Decode\nVAE decoders\n-> VIDEO, AUDIO", _DIFFUSION),
]
_BOX_HEIGHT = 8.5


def architecture(path: Path) -> Path:
    """Boxes and arrows: media -> local encoder nodes or the remote endpoint -> CONDITIONING -> Sampler -> Decode."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    plt = _pyplot()
    fig = plt.figure(figsize=ARCHITECTURE_INCHES, dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 100), ax.set_ylim(0, 42), ax.axis("off")
    # The two lanes, and the machine boundary of the remote path.
    ax.add_patch(Rectangle((16.5, 24.5), 51.5, 15, facecolor="#f7fbff", edgecolor="#9ab", linewidth=0.8))
    ax.text(17.3, 38.3, "local: three encoder nodes in the ComfyUI graph", fontsize=8, color="#456", va="top")
    ax.add_patch(Rectangle((38.5, 3.5), 28, 15, facecolor="none", edgecolor="#c33", linewidth=1.2, linestyle="--"))
    ax.text(39.2, 17.8, "another machine", fontsize=8, color="#c33", va="top")
    ax.text(17.3, 20.6, "remote: one node, the encoders elsewhere", fontsize=8, color="#456", va="top")
    ax.text(86.5, 39.5, "both paths:\nDiT + VAE decoders", fontsize=8, color="#363", ha="center", va="top")
    edges = {}
    for key, x, y, width, text, colour in _BOXES:
        ax.add_patch(FancyBboxPatch((x - width / 2, y - _BOX_HEIGHT / 2), width, _BOX_HEIGHT,
                                    boxstyle="round,pad=0.3,rounding_size=0.8", facecolor=colour,
                                    edgecolor="#555", linewidth=0.9))
        lines = text.split("\n")
        ax.text(x, y + 0.2, lines[0] + "\n" * (len(lines) - 1), fontsize=8.5, weight="bold", ha="center", va="center")
        if len(lines) > 1:
            ax.text(x, y + 0.2, "\n" + "\n".join(lines[1:]), fontsize=7.5, ha="center", va="center", color="#333")
        edges[key] = (x - width / 2 - 0.3, x + width / 2 + 0.3, y - _BOX_HEIGHT / 2 - 0.3, y + _BOX_HEIGHT / 2 + 0.3)

    def arrow(start, end, label=None, offset=(0.0, 1.2), style="-|>", colour="#333"):
        ax.annotate("", xy=end, xytext=start,
                    arrowprops={"arrowstyle": style, "color": colour, "linewidth": 1.1, "shrinkA": 0, "shrinkB": 0})
        if label:
            ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], label,
                    fontsize=7, ha="center", va="bottom", color=colour)

    right = lambda key: (edges[key][1], (edges[key][2] + edges[key][3]) / 2)
    left = lambda key: (edges[key][0], (edges[key][2] + edges[key][3]) / 2)
    arrow(right("media"), left("text"))
    arrow(right("media"), left("remote"))
    arrow(right("text"), left("video"))
    arrow(right("video"), left("audio"))
    arrow(right("audio"), left("cond"))
    # The request and its answer: media over HTTP in, the conditioning back as one safetensors body.
    arrow((edges["remote"][1], 12), (edges["server"][0], 12), "media (HTTP)", offset=(0.0, 0.4))
    arrow((edges["server"][0], 8), (edges["remote"][1], 8), "safetensors", offset=(0.0, 0.4))
    # Remote Encode's output: under the other machine's box, then up into CONDITIONING.
    ax.plot([27, 27, 73, 73], [edges["remote"][2], 1.5, 1.5, edges["cond"][2] - 3], color="#333", linewidth=1.1)
    arrow((73, edges["cond"][2] - 3), (73, edges["cond"][2]))
    ax.text(52.5, 1.9, "the same H3Conditioning a local encode gives (docs/PROTOCOL.md)", fontsize=7, ha="center",
            va="bottom", color="#333")
    arrow(right("cond"), left("sampler"))
    arrow((86.5, edges["sampler"][2]), (86.5, edges["decode"][3]), "latent", offset=(2.6, -0.9))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mp4", type=Path, default=DEFAULT_MP4, help="the demo's mp4 (bash scripts/demo.sh)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the PNGs go")
    parser.add_argument("--skip-demo", action="store_true", help="redraw only architecture.png")
    args = parser.parse_args(argv)
    written = [architecture(args.out / "architecture.png")]
    if not args.skip_demo:
        if not args.mp4.is_file():
            parser.error(f"{args.mp4} does not exist: run `bash scripts/demo.sh` first, or pass --mp4")
        clip = media.read_video(args.mp4)
        written += [contact_sheet(clip, args.out / "demo_contact_sheet.png"),
                    waveform(clip, args.out / "demo_waveform.png")]
    for path in written:
        print(f"{path} ({path.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
