import numpy as np
import pytest
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import (Preprocess, eval_transform, load_image, scan_image_folder, scan_pool,
                                       train_transform)


@pytest.mark.parametrize("mode,make", [
    ("L", lambda: Image.new("L", (8, 8), 128)),
    ("RGBA", lambda: Image.new("RGBA", (8, 8), (255, 0, 0, 0))),
    ("P", lambda: Image.new("P", (8, 8), 3)),
    ("I;16", lambda: Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)),
    ("CMYK", lambda: Image.new("CMYK", (8, 8), (0, 255, 255, 0))),
])
def test_modes_convert_to_rgb(tmp_path, mode, make):
    im = make()
    path = tmp_path / ("x.tif" if mode in ("I;16", "CMYK") else "x.png")
    im.save(path)
    out = load_image(path)
    assert out is not None and out.mode == "RGB" and out.size == (8, 8)
    if mode == "RGBA":  # fully transparent red composites onto white, not black or red
        assert out.getpixel((0, 0)) == (255, 255, 255)
    if mode == "I;16":  # the 16-bit range is scaled, not clipped to 255
        arr = np.asarray(out)[..., 0]
        assert arr.min() == 0 and arr.max() == 255
    if mode == "CMYK":
        r, g, b = out.getpixel((0, 0))
        assert r > 200 and g < 60 and b < 60


def test_corrupt_and_truncated_return_none(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not an image at all")
    Image.new("RGB", (64, 64), (10, 20, 30)).save(tmp_path / "ok.jpg", quality=95)
    data = (tmp_path / "ok.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    assert load_image(tmp_path / "bad.jpg") is None
    assert load_image(tmp_path / "trunc.jpg") is None
    assert load_image(tmp_path / "ok.jpg") is not None


def _folder(root, classes, n=2):
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / c / f"{i}.png")


def test_scan_counts_corrupt_and_rejects_empty_class(tmp_path):
    _folder(tmp_path / "train", ["a", "b"])
    (tmp_path / "train" / "a" / "broken.png").write_bytes(b"\x89PNG garbage")
    scan = scan_image_folder(tmp_path / "train", "train")
    assert scan.classes == ["a", "b"] and len(scan.samples) == 4 and len(scan.corrupt) == 1
    (tmp_path / "train" / "c").mkdir()
    with pytest.raises(ToolchainError, match=r"class folder .*c' has no images"):
        scan_image_folder(tmp_path / "train", "train")


def test_missing_folder_and_empty_pool(tmp_path):
    with pytest.raises(ToolchainError, match="does not exist"):
        scan_image_folder(tmp_path / "nope", "val")
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "notes.txt").write_text("hi")
    with pytest.raises(ToolchainError, match="has no images"):
        scan_pool([tmp_path / "pool"])


def test_tar_shards_and_file_lists_as_pools(tmp_path):
    import io
    import tarfile

    from vfm_toolchain.data.pools import TAR_SEP

    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tf:
        for i, payload in enumerate([None, None, b"corrupt bytes"]):
            buf = io.BytesIO()
            if payload is None:
                Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(buf, format="JPEG")
                payload = buf.getvalue()
            info = tarfile.TarInfo(f"{i:04d}.jpg")
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
        meta = b'{"caption": "not an image"}'
        info = tarfile.TarInfo("0000.json")
        info.size = len(meta)
        tf.addfile(info, io.BytesIO(meta))
    good, corrupt = scan_pool([str(tmp_path / "shard-*.tar")])
    assert good == [f"{shard}{TAR_SEP}0000.jpg", f"{shard}{TAR_SEP}0001.jpg"]
    assert corrupt == [f"{shard}{TAR_SEP}0002.jpg"]
    assert load_image(good[1]).getpixel((0, 0))[0] > 30
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "list.txt").write_text("# pool\na.png\nmissing.png\n\n")
    good, corrupt = scan_pool([str(tmp_path / "list.txt")])
    assert good == [str(tmp_path / "a.png")] and corrupt == [str(tmp_path / "missing.png")]
    with pytest.raises(ToolchainError, match="matches no files"):
        scan_pool([str(tmp_path / "nothing-*.tar")])


def _png_shard(path, images):
    """A WebDataset-style shard: one PNG per key (lossless, so decoded pixels can be compared exactly)."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for i, arr in enumerate(images):
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            info = tarfile.TarInfo(f"{i:06d}.png")
            info.size = len(buf.getvalue())
            tf.addfile(info, io.BytesIO(buf.getvalue()))


def test_tar_shard_pool_through_forked_workers(tmp_path, monkeypatch):
    """Decoding a shard pool in DataLoader workers forked after the parent opened the shards: every image
    decodes to its own pixels (the old tarfile reader shared one file offset between processes and tore
    a few reads per epoch of this pool into other members' bytes), and a process keeps at most
    MAX_OPEN_SHARDS shards open however many the pool has."""
    import torch

    from vfm_toolchain.data import pools
    from vfm_toolchain.data.images import ImageListDataset

    monkeypatch.setattr(pools, "MAX_OPEN_SHARDS", 2)
    pools.close_shards()
    rng = np.random.default_rng(0)
    expected = {}
    for s in range(4):
        images = [rng.integers(0, 256, (96, 96, 3), dtype=np.uint8) for _ in range(16)]  # noise: ~27 KB each
        _png_shard(tmp_path / f"pool-{s:03d}.tar", images)
        for i, arr in enumerate(images):
            expected[f"{tmp_path / f'pool-{s:03d}.tar'}{pools.TAR_SEP}{i:06d}.png"] = arr
    good, corrupt = scan_pool([str(tmp_path / "pool-*.tar")], verify=False)  # the parent maps shards, then forks
    assert sorted(good) == sorted(expected) and corrupt == []
    assert 0 < len(pools._shards()) <= 2
    ds = ImageListDataset([(p, n) for n, p in enumerate(good)],
                          lambda im: torch.from_numpy(np.asarray(im).copy()), cache_mb=0)
    torn = 0
    for epoch in range(3):
        dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(epoch),
                                         multiprocessing_context="fork")
        for x, idx in dl:
            torn += sum(not np.array_equal(img.numpy(), expected[good[n]]) for img, n in zip(x, idx.tolist()))
    assert torn == 0 and ds.failed == 0
    pools.close_shards()


def test_tar_shard_with_long_member_names_is_refused(tmp_path):
    from vfm_toolchain.data.pools import close_shards

    import io
    import tarfile

    with tarfile.open(tmp_path / "long.tar", "w") as tf:
        buf = io.BytesIO()
        Image.new("RGB", (4, 4)).save(buf, format="PNG")
        info = tarfile.TarInfo("d" * 120 + "/x.png")
        info.size = len(buf.getvalue())
        tf.addfile(info, io.BytesIO(buf.getvalue()))
    with pytest.raises(ToolchainError, match="short keys"):
        scan_pool([str(tmp_path / "long.tar")])
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ToolchainError, match="not a readable tar"):
        scan_pool([str(tmp_path / "empty.tar")])
    close_shards()


def test_height_width_sizes_reach_every_transform(tmp_path):
    from vfm_toolchain.students.distill import TransferViews

    pp = Preprocess((24, 40))
    assert Preprocess.from_dict(pp.to_dict()) == pp and pp.to_dict()["size"] == [24, 40]
    assert Preprocess([32, 32]).size == 32 and Preprocess(32).to_dict()["size"] == 32  # squares keep one side
    Image.new("RGB", (50, 30), (10, 200, 30)).save(tmp_path / "a.png")
    im = load_image(tmp_path / "a.png")
    assert eval_transform(pp)(im).shape == (3, 24, 40) and train_transform(pp)(im).shape == (3, 24, 40)
    views = TransferViews([str(tmp_path / "a.png")], views=2, seed=0, teacher_pp=Preprocess(32), student_pp=pp)
    assert views.view(0, 0).size == views.view(0, 1).size == (40, 32)  # PIL (w, h): each side's larger need
    assert views.teacher_input(0, 1).shape == (3, 32, 32)
    assert views[0][0].shape == (3, 24, 40)


def test_strong_label_augmentation(tmp_path):
    import torch

    from vfm_toolchain.data.segmentation import SegmentationDataset, scan_segmentation_folder
    from vfm_toolchain.data.synthetic import generate_segmentation_task

    pp = Preprocess((24, 40))
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 50, 3), dtype=np.uint8))
    torch.manual_seed(0)
    light = train_transform(pp)(im)
    torch.manual_seed(0)
    strong = train_transform(pp, "strong")(im)
    assert light.shape == strong.shape == (3, 24, 40) and not torch.allclose(light, strong)
    with pytest.raises(ToolchainError, match="use light or strong"):
        train_transform(pp, "heavy")
    # segmentation: the colour ops come after the shared geometry and touch the image only
    seg = generate_segmentation_task(tmp_path / "seg", 2, 2, 1, 1, 1, 0, 32, 0)
    pairs, _ = scan_segmentation_folder(seg["train"], "train", 3)
    out = {}
    for augment in ("light", "strong"):
        torch.manual_seed(3)
        out[augment] = SegmentationDataset(pairs, Preprocess(32), train=True, augment=augment)[0]
    assert torch.equal(out["light"][1], out["strong"][1]) and not torch.allclose(out["light"][0], out["strong"][0])


