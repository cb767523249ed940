"""Headless Chromium for the `browser` tests (tests/conftest.py skips them without it): a
driver, and whether a screenshot shows segment colours."""

import io
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def chromium(profile: Path):
    """A headless Chromium driver (selenium's), its profile in `profile`; the caller quits it.
    Software WebGL (SwiftShader): Neuroglancer draws without a GPU."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in (
        "--headless=new --no-sandbox --use-angle=swiftshader --enable-unsafe-swiftshader "
        "--disable-background-networking --disable-component-update --no-first-run "
        "--disable-sync --disable-gpu --window-size=1000,800"
    ).split():
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # its console: get_log
    options.binary_location = shutil.which("chromium")
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def coloured(png: bytes, half: str) -> bool:
    """Whether one half of a screenshot shows segment colours: over 5% of its pixels strongly
    coloured, in at least 5 distinct hues (of 24) of 500 pixels each. The EM image is grey; the
    UI's few coloured lines and the yellow bounding box stay far below that."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    width, height = image.size
    image = image.crop(
        (0, 0, width // 2, height) if half == "left" else (width // 2, 0, width, height)
    )
    rgb = np.asarray(image).astype(np.int32)
    high, low = rgb.max(-1), rgb.min(-1)
    mask = (high - low > 60) & (high > 80)
    hue = np.asarray(image.convert("HSV"))[..., 0][mask].astype(np.int32)
    hues = np.bincount(hue * 24 // 256, minlength=24)
    return mask.mean() > 0.05 and np.count_nonzero(hues >= 500) >= 5


def wait_for(condition: Callable[[], T], seconds: float) -> T:
    """`condition()`'s first true result within `seconds`, polled each second; else its last."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(1)
    return condition()
