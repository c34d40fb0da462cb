"""Pictures of a transfer set a person looks at (seed 004 Figs. 7-8): queries with the pool images they
brought in, and a 2D map (PCA, t-SNE or UMAP) of the queries, a pool sample and the selection."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write
from vfm_toolchain.data.images import load_image
from vfm_toolchain.sheets import Cell, save_sheet

__all__ = ["plot_neighbours", "plot_map", "project_2d", "check_map"]


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def plot_neighbours(path: Path, queries: List[str], sel_paths: List[str], sel_queries: np.ndarray,
                    sel_dist: np.ndarray, rows: int = 6, per_row: int = 6,
                    query_image: Optional[Callable[[int], Optional[Image.Image]]] = None) -> None:
    """Up to ``rows`` queries, spread over those that brought images in, each beside its ``per_row`` nearest
    transfer images (captioned with their distance).  ``query_image(q)``: the picture of query q when it is not an
    image file (a detection object crop); default: the file ``queries[q]``; a text query is written out."""
    shown = [q for q in np.unique(sel_queries)][:: max(1, len(np.unique(sel_queries)) // rows)][:rows]
    grid = []
    for q in shown:
        if queries[q].startswith("text: "):
            row = [Cell(text=queries[q][6:], caption="query", color="crimson")]
        else:
            row = [Cell(query_image(q) if query_image is not None else load_image(queries[q]), "query", "crimson")]
        mine = np.flatnonzero(sel_queries == q)
        mine = mine[np.argsort(sel_dist[mine])][:per_row]
        grid.append(row + [Cell(load_image(sel_paths[i]), f"{sel_dist[i]:.2f}") for i in mine])
    save_sheet(path, grid, "queries and the transfer images they retrieved (distance)", cell=(112, 112))


def project_2d(data: np.ndarray, method: str, seed: int = 0) -> np.ndarray:
    """(N, D) -> (N, 2) by PCA, t-SNE (scikit-learn) or UMAP (umap-learn, optional)."""
    if method == "pca":
        centred = data - data.mean(0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)  # the two leading directions
        return centred @ vt[:2].T
    if method == "tsne":
        from sklearn.manifold import TSNE

        return TSNE(2, perplexity=min(30.0, max(2.0, (len(data) - 1) / 3)), init="pca",
                    random_state=seed).fit_transform(data)
    if method == "umap":
        check_map(method)
        try:
            import umap
        except ImportError as exc:  # installed but broken (numba against another numpy, ...)
            raise ToolchainError(f"curate.map 'umap': umap-learn is installed but does not import ({exc}); "
                                 f"{_UMAP_FIX}") from None
        return umap.UMAP(n_components=2, random_state=seed).fit_transform(data)
    raise ToolchainError(f"unknown curate.map '{method}'; use pca, tsne or umap")


_UMAP_FIX = "pip install 'vfm-toolchain[umap]' (or pip install umap-learn), or set curate.map to pca or tsne"


def check_map(method: str) -> None:
    """The map's optional library is installed: said before the first stage (the map is drawn at the end of
    teacher.curate, after the teacher trained), and again where it is drawn.  Only looked up, not imported:
    importing umap compiles numba code for seconds."""
    import importlib.util

    if method == "umap" and importlib.util.find_spec("umap") is None:
        raise ToolchainError(f"curate.map 'umap' needs umap-learn, which is not installed here: {_UMAP_FIX}")


def plot_map(path: Path, q_emb: np.ndarray, vectors, selected: np.ndarray, method: str = "pca",
             sample: int = 3000, seed: int = 0) -> None:
    """``vectors``: the pool's :class:`~teachers.vectors.PoolVectors`; only a sample of it is read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(seed)
    pool_ids = np.sort(rng.choice(len(vectors), min(sample, len(vectors)), replace=False))
    sel_ids = np.sort(selected if len(selected) <= sample else rng.choice(selected, sample, replace=False))
    parts = [vectors.take(pool_ids), vectors.take(sel_ids), np.asarray(q_emb, dtype=np.float32)]
    xy = project_2d(np.concatenate(parts), method, seed)
    bounds = np.cumsum([0] + [len(p) for p in parts])
    fig, ax = plt.subplots(figsize=(5.5, 4.5), dpi=110)
    for i, style in enumerate((dict(s=4, c="lightgrey", label="pool (sample)"),
                               dict(s=6, c="tab:blue", label="transfer set"),
                               dict(s=40, c="crimson", marker="*", label="queries"))):
        pts = xy[bounds[i]:bounds[i + 1]]
        ax.scatter(pts[:, 0], pts[:, 1], **style)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"embeddings, {method.upper() if method != 'tsne' else 't-SNE'}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    _save(fig, path)
