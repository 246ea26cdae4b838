"""The processor of examples/thumbnails.py: denoise, shrink, sharpen and save one image.

The denoise strength comes from the file itself (a PNG text field), which is how one bad
file can hang a batch: a median filter's cost grows with the square of its size, and it
runs inside one C call of Pillow, where no Python signal handler can run, so the soft
timeout cannot interrupt it. Only the hard timeout's kill ends it.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageFilter

from sandboxq import SoftTimeout


def thumbnail(src: str, out_dir: str, size: int = 128) -> dict[str, object]:
    out = Path(out_dir) / (Path(src).stem + ".jpg")
    partial = out.with_suffix(".part")
    try:
        with Image.open(src) as image:
            denoise = int(image.info.get("denoise", "3"))  # trusted from the file: the bug
            pixels = image.convert("RGB").filter(ImageFilter.MedianFilter(denoise))
        pixels.thumbnail((size, size), Image.Resampling.LANCZOS)
        pixels = pixels.filter(ImageFilter.UnsharpMask(radius=1.5, percent=80))
        pixels.save(partial, "JPEG", quality=85)
        partial.replace(out)  # a thumbnail appears whole or not at all
    except SoftTimeout:
        partial.unlink(missing_ok=True)  # out of time: leave no half-written file behind
        raise
    return {"file": out.name, "size": list(pixels.size), "bytes": out.stat().st_size}
