"""evals/report.py's page in a real headless browser: every figure and table fits the window, none is cropped.

A three-panel curve is a 1,440 px PNG; in a 960 px page without max-width it ran off screen (issue #41). Checking the
HTML text cannot see that, so a headless Chromium lays the page out and a probe script writes each image's box and
the page's scroll width into the DOM, which --dump-dom returns. Skips when no Chromium is installed."""

import html
import json
import re
import shutil
import subprocess

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)

pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="no chromium, chromium-browser or google-chrome on PATH: the report page's layout is not checked in a "
    "browser (apt-get install chromium)",
)

# Runs on the page's load event, when every data-URI image has been decoded and laid out.
PROBE = """<script>window.addEventListener("load", function () {
  var images = Array.from(document.images).map(function (img) {
    var box = img.getBoundingClientRect();
    return {left: box.left, right: box.right, width: box.width, height: box.height,
            natural_width: img.naturalWidth, natural_height: img.naturalHeight, complete: img.complete};
  });
  var out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({client_width: document.documentElement.clientWidth,
                                    scroll_width: document.documentElement.scrollWidth, images: images});
  document.body.appendChild(out);
});</script>"""


def layout(page_path, tmp_path, width: int) -> dict:
    """The probe's measurements of the page at path, opened in a headless browser window `width` px wide."""
    probed = tmp_path / f"probed_{width}.html"
    page = page_path.read_text()
    assert page.count("</body>") == 1
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    cmd = [
        BROWSER,
        "--headless",
        "--no-sandbox",  # root in containers and CI has no user namespace for Chromium's sandbox
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--window-size={width},800",
        "--dump-dom",
        probed.as_uri(),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert found, f"{BROWSER} gave no probe output (rc {result.returncode}): {result.stderr[-1000:]}"
    return json.loads(html.unescape(found.group(1)))


def test_report_page_fits_the_window_in_a_browser(tmp_path):
    from evals.report import Args, main

    # Three run kinds make three panels per curve (the widest figure); long run names and many eval keys make the
    # runs table wider than the page.
    runs = []
    for kind in ("sft", "dpo", "grpo"):
        run = tmp_path / f"{kind}__SmolLM2-135M-Instruct__42__20260101-000000-abcdef"
        run.mkdir()
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, 13):
                row = {"step": step, "loss": 1 / step, "reward": 0.05 * step, "kl": 0.01 * step}
                row.update({f"eval/task_{i}/prompt_level_strict_acc": 0.1 * i for i in range(6)})
                f.write(json.dumps(row) + "\n")
        runs.append(str(run))
    out = main(Args(runs=tuple(runs), out=str(tmp_path / "report")))
    assert len(out["plots"]) == 9

    for width in (1024, 480):  # a laptop window and half of one
        probe = layout(tmp_path / "report" / "report.html", tmp_path, width)
        images = probe["images"]
        assert len(images) == len(out["plots"])
        assert all(img["complete"] and img["natural_width"] == 1440 for img in images), images
        view = probe["client_width"]
        for img in images:
            assert img["left"] >= 0 and img["right"] <= view, f"window {width} px: an image spans {img} in {view} px"
            # scaled, not squeezed: the rendered box keeps the PNG's aspect ratio
            ratio = img["natural_width"] / img["natural_height"]
            assert img["width"] / img["height"] == pytest.approx(ratio, rel=0.02), img
        assert probe["scroll_width"] <= view, f"window {width} px: the page scrolls sideways ({probe})"
