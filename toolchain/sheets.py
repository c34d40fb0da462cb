"""Sheets of images a person looks at: a grid of thumbnails, each with a caption above it, under a title.

One place for every such picture the toolchain writes: the transfer set's queries beside the pool images they
brought in (``teacher.curate``), the images ``label-next`` chose, and the detection sheet of the report.  Composed
with Pillow: matplotlib, which drew them before, spent 2.9 s of a tiny build's 16.6 s of CPU on the 6 x 7 sheet of
its curation (cProfile; an Axes per cell, then ``tight_layout``); pasting thumbnails is a few milliseconds a cell.
Charts (axes, ticks, legends) stay with matplotlib.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from vfm_toolchain.core.files import atomic_write

__all__ = ["Cell", "save_sheet"]

GAP = 6          # pixels between cells and around the sheet
CAPTION = 11     # caption font size (px); the title's is larger


@dataclass
class Cell:
    """One place in the grid: an image scaled to fit it (a PIL image or an H x W x 3 uint8 array), or, without one,
    ``text`` written inside it (a text query); ``caption`` goes above it, in ``color``."""
    image: Optional[Union[Image.Image, np.ndarray]] = None
    caption: str = ""
    color: str = "black"
    text: str = ""


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow's scalable font (needs FreeType)
    except (TypeError, OSError):  # an older Pillow, or one built without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> str:
    """``text`` shortened with an ellipsis until it is at most ``width`` pixels wide."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def save_sheet(path: Path, rows: Sequence[Sequence[Cell]], title: str, cell: Tuple[int, int] = (128, 128),
               heads: Sequence[str] = ()) -> None:
    """Write the grid as a PNG, atomically.  ``rows``: the cells of each row (rows may be shorter than the
    longest, and a ``Cell()`` leaves its place empty); ``cell``: (width, height) each image is scaled to fit, its
    aspect ratio kept; ``heads``: a heading over each column."""
    cw, ch = cell
    cols = max((len(r) for r in rows), default=0)
    title_font, head_font, font = _font(CAPTION + 4), _font(CAPTION + 2), _font(CAPTION)
    line = CAPTION + 4
    top = GAP + line + 4 + GAP + (line + 2 if heads else 0)
    width = GAP + max(cols, 1) * (cw + GAP)
    height = top + len(rows) * (line + ch + GAP)
    sheet = Image.new("RGB", (max(width, 200), height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((GAP, GAP), _fit(draw, title, title_font, sheet.width - 2 * GAP), fill="black", font=title_font)
    for c, head in enumerate(heads):
        draw.text((GAP + c * (cw + GAP), top - line - 2), _fit(draw, head, head_font, cw), fill="black",
                  font=head_font)
    for r, row in enumerate(rows):
        y = top + r * (line + ch + GAP)
        for c, item in enumerate(row):
            x = GAP + c * (cw + GAP)
            if item.caption:
                draw.text((x, y), _fit(draw, item.caption, font, cw), fill=item.color, font=font)
            if item.image is not None:
                im = item.image if isinstance(item.image, Image.Image) else Image.fromarray(np.asarray(item.image))
                im = ImageOps.contain(im.convert("RGB"), (cw, ch))  # up or down to the cell, aspect kept
                sheet.paste(im, (x + (cw - im.width) // 2, y + line + (ch - im.height) // 2))
            elif item.text:
                per_line = max(4, int(cw / (0.6 * CAPTION)))
                text = "\n".join(textwrap.wrap(item.text, per_line)[: max(1, ch // line)])
                left, upper, right, lower = draw.multiline_textbbox((0, 0), text, font=font)
                draw.multiline_text((x + (cw - right + left) // 2, y + line + (ch - lower + upper) // 2), text,
                                    fill="black", font=font, align="center")
    atomic_write(Path(path), lambda tmp: sheet.save(tmp, format="PNG"))
