"""Pictures of a transfer set a person looks at (seed 004 Figs. 7-8): queries with the pool images they
brought in, and a 2D map (PCA) of the queries, a pool sample and the selection."""
from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np

from toolchain.data import load_image
from toolchain.store import atomic_write

__all__ = ["plot_neighbours", "plot_map"]


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def plot_neighbours(path: Path, queries: List[str], sel_paths: List[str], sel_queries: np.ndarray,
                    sel_dist: np.ndarray, rows: int = 6, per_row: int = 6) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [q for q in np.unique(sel_queries)][:: max(1, len(np.unique(sel_queries)) // rows)][:rows]
    fig, axes = plt.subplots(len(shown), per_row + 1, figsize=(1.4 * (per_row + 1), 1.5 * len(shown)), dpi=100,
                             squeeze=False)
    for r, q in enumerate(shown):
        ax = axes[r, 0]
        if queries[q].startswith("text: "):
            ax.text(0.5, 0.5, queries[q][6:], ha="center", va="center", wrap=True, fontsize=8)
        else:
            im = load_image(queries[q])
            if im is not None:
                ax.imshow(im)
        ax.set_title("query", fontsize=7, color="crimson")
        mine = np.flatnonzero(sel_queries == q)
        mine = mine[np.argsort(sel_dist[mine])][:per_row]
        for c in range(per_row):
            ax = axes[r, c + 1]
            if c < len(mine):
                im = load_image(sel_paths[mine[c]])
                if im is not None:
                    ax.imshow(im)
                ax.set_title(f"{sel_dist[mine[c]]:.2f}", fontsize=7)
    for ax in axes.ravel():
        ax.axis("off")
    fig.suptitle("queries and the transfer images they retrieved (distance)", fontsize=9)
    fig.tight_layout()
    _save(fig, path)


def plot_map(path: Path, q_emb: np.ndarray, p_emb: np.ndarray, selected: np.ndarray, sample: int = 3000,
             seed: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(seed)
    pool_ids = rng.choice(len(p_emb), min(sample, len(p_emb)), replace=False)
    sel_ids = selected if len(selected) <= sample else rng.choice(selected, sample, replace=False)
    data = np.concatenate([p_emb[pool_ids], p_emb[sel_ids], q_emb])
    centre = data.mean(0)
    _, _, vt = np.linalg.svd(data - centre, full_matrices=False)  # PCA: the two leading directions
    xy = lambda x: (x - centre) @ vt[:2].T
    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=110)
    for pts, style in ((xy(p_emb[pool_ids]), dict(s=4, c="lightgrey", label="pool (sample)")),
                       (xy(p_emb[sel_ids]), dict(s=6, c="tab:blue", label="transfer set")),
                       (xy(q_emb), dict(s=40, c="crimson", marker="*", label="queries"))):
        ax.scatter(pts[:, 0], pts[:, 1], **style)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("embeddings, PCA", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    _save(fig, path)
