"""Redraw the right panel of docs/img/main-job-4hosts-100mbit.png in the docs' one direction for
ratios (x DDP's time, lower is sooner), from the same run's figures in docs/results.json (run
``main-job-4hosts-100mbit-2026-11-25``).  That run's JSON was not kept, so its left panel (the
loss curves), title and legend stay as the run drew them; the old right panel (DDP's time over
each row's) is blanked and drawn again.  Idempotent.  Once the main job is re-run at depth,
its own plot replaces this picture and this script goes.

    python benchmarks/e2e/_redraw_main_job_2026_11_25.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
PNG = ROOT / "docs" / "img" / "main-job-4hosts-100mbit.png"
RUN = "main-job-4hosts-100mbit-2026-11-25"
ORDER = ["ddp_powersgd", "ddp_bytegrad_hook", "bytegrad", "topk", "low_rank", "local_sgd",
         "diloco", "ft_diloco"]


def main() -> None:
    img = mpimg.imread(PNG).copy()
    h, w = img.shape[:2]
    img[int(h * 0.065):int(h * 0.895), int(w * 0.39):, :3] = 1.0   # the right panel, blanked
    results = json.loads((ROOT / "docs" / "results.json").read_text())
    rows = results["runs"][RUN]["figures"]["rows"]
    dpi = 100
    fig = plt.figure(figsize=(w / dpi, h / dpi), dpi=dpi)
    base = fig.add_axes([0, 0, 1, 1])
    base.imshow(img)
    base.axis("off")
    ax = fig.add_axes([0.52, 0.22, 0.42, 0.66])
    vals = [rows[k]["x_ddp_time"]["ddp@30"] for k in ORDER]
    ax.barh(range(len(ORDER)), vals, color="tab:blue")
    for i, v in enumerate(vals):
        ax.text(v + 0.01, i, f"{v:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(ORDER)), ORDER, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlim(0, 1.2)
    ax.set_xlabel("time to DDP's loss after 30 steps, x DDP's time (< 1 = sooner than DDP)",
                  fontsize=9)
    ax.set_title("who reaches DDP's loss sooner, by how much", fontsize=9)
    fig.savefig(PNG, dpi=dpi)


if __name__ == "__main__":
    main()
