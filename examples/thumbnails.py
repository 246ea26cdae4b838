"""A real CPU-heavy batch: generate images, then make thumbnails of them in sandboxed
children with Pillow, with soft and hard timeouts. One file is bad and hangs its job in
C code; that job is killed at its hard timeout and the rest of the batch completes.

    python examples/thumbnails.py [OUT_DIR]      # default: a temporary directory
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # finds jobs_thumbnails

from PIL import Image, PngImagePlugin

from sandboxq import JobFailed, Queue, SandboxWorker

IMAGES = 12


def generate(folder: Path) -> list[Path]:
    """Fractal test images (400x300 PNG); ``stuck.png`` asks for a huge median filter."""
    paths = []
    for i in range(IMAGES):
        zoom = 1.0 / (1 + i)
        extent = (-0.75 - 1.5 * zoom, -1.2 * zoom, -0.75 + 1.5 * zoom, 1.2 * zoom)
        image = Image.effect_mandelbrot((400, 300), extent, 64 + 8 * i)
        paths.append(folder / f"fractal-{i:02}.png")
        image.save(paths[-1])
    bad = PngImagePlugin.PngInfo()
    bad.add_text("denoise", "255")  # a corrupt value: minutes of work inside one C call
    Image.effect_mandelbrot((400, 300), (-2.2, -1.2, 1.0, 1.2), 64).save(
        folder / "stuck.png", pnginfo=bad
    )
    return [*paths, folder / "stuck.png"]


def main(out_dir: Path) -> None:
    sources = out_dir / "in"
    thumbs = out_dir / "thumbs"
    sources.mkdir(parents=True, exist_ok=True)
    thumbs.mkdir(exist_ok=True)
    files = generate(sources)
    print(f"generated {len(files)} images in {sources}")

    queue = Queue("thumbnails", url="memory://")
    jobs = {path.name: queue.enqueue(str(path), str(thumbs), size=128) for path in files}
    worker = SandboxWorker(
        "thumbnails",
        "jobs_thumbnails:thumbnail",
        url="memory://",
        concurrency=2,
        soft_timeout_s=2.0,  # SoftTimeout is raised in the handler: clean up and give up
        hard_timeout_s=3.0,  # then the child's whole process tree is killed
    )
    started = time.monotonic()
    thread = threading.Thread(target=worker.run, kwargs={"burst": True})
    thread.start()

    done = failed = 0
    for name, job in jobs.items():
        try:
            thumb = job.result(timeout_s=60)
            done += 1
            print(f"  {name:16} -> {thumb['file']:16} {thumb['size']}  {thumb['bytes']:>6} bytes")
        except JobFailed as err:
            failed += 1
            attempt = job.info().history[-1]
            print(f"  {name:16} !! {err.error} (child pid {attempt.pid}, signal {attempt.signal})")
    thread.join()
    leftovers = sorted(p.name for p in thumbs.glob("*.part"))
    print(
        f"{done} thumbnails, {failed} failed, in {time.monotonic() - started:.1f} s; "
        f"half-written files left: {leftovers or 'none'}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory(prefix="sandboxq-thumbnails-") as tmp:
            main(Path(tmp))
