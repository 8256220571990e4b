"""Write the trainer's synthetic set as an image folder, for tests and demos of ``--dataset imagefolder``.

    python -m benchmarks.make_image_folder DIR [--classes 10] [--train-size 2000] [--val-size 500] [--size 32]
                                               [--format png]

gives DIR/train/class000/000017.png ... and DIR/val/..., torchvision's ImageFolder layout. The images are
data.make_synthetic's (the same seed gives the same files), with labels drawn from --classes classes,
upscaled (bicubic) to --size pixels when asked, and saved losslessly (png) or as JPEG (quality 90, like most
photo collections). Every class gets at least one training image, or the command says which sizes to raise.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from PIL import Image
from tqdm import tqdm

from data import make_synthetic


def write_image_folder(root: str, classes: int = 10, train_size: int = 2000, val_size: int = 500, size: int = 32,
                       image_format: str = "png", seed: int = 0) -> None:
    """Write ``train_size`` + ``val_size`` synthetic images under ``root``/{train,val}/classNNN/."""
    train, val = make_synthetic(train_size, val_size, seed, num_classes=classes)
    for split, images in (("train", train), ("val", val)):
        missing = sorted(set(range(classes)) - set(images.labels.tolist()))
        if split == "train" and missing:
            raise ValueError(f"class {missing[0]} got no training image: raise --train-size or lower --classes")
        # Every class has a training folder; a small validation split may lack a class, and an empty folder
        # would be refused by the trainer, so validation gets the folders of the classes it has.
        for c in range(classes) if split == "train" else sorted(set(images.labels.tolist())):
            os.makedirs(os.path.join(root, split, f"class{c:03d}"), exist_ok=True)
        pixels = images.images.permute(0, 2, 3, 1).numpy()  # (N, H, W, 3) uint8, as PIL wants
        for i in tqdm(range(len(images)), desc=f"{split} images", disable=not sys.stderr.isatty(), leave=False):
            image = Image.fromarray(np.ascontiguousarray(pixels[i]))
            if size != image.width:
                image = image.resize((size, size), Image.Resampling.BICUBIC)
            name = os.path.join(root, split, f"class{int(images.labels[i]):03d}", f"{i:06d}.{image_format}")
            image.save(name, quality=90) if image_format == "jpg" else image.save(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the folder to write (train/ and val/ are made in it)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--val-size", type=int, default=500)
    parser.add_argument("--size", type=int, default=32, help="side of the written images, in pixels")
    parser.add_argument("--format", choices=("png", "jpg"), default="png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for flag, value in (("--classes", args.classes), ("--train-size", args.train_size),
                        ("--val-size", args.val_size), ("--size", args.size)):
        if value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    try:
        write_image_folder(args.root, args.classes, args.train_size, args.val_size, args.size, args.format,
                           args.seed)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    print(f"wrote {args.train_size} training and {args.val_size} validation images of {args.classes} classes "
          f"to {args.root}")


if __name__ == "__main__":
    main()
