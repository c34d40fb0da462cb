"""The readers: images and class folders, COCO and YOLO boxes, image/mask folders, tag CSVs and COCO image tags,
unlabeled pools and tar shards, and the generated tasks the quickstarts and tests build from.  Every path a data
file names is checked against the data roots (core/roots.py); a corrupt image is skipped and counted.  The tasks
(toolchain/tasks/) choose which reader a recipe uses; nothing here reads a recipe."""
