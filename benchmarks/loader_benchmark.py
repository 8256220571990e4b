"""The streaming image-folder pipeline: loader throughput against training throughput, and memory.

    python -m benchmarks.loader_benchmark [--workers 0,1,2] [--size 64] [--train-size 2000] [--json FILE]

Writes two folders of the synthetic set as JPEG files (make_image_folder.py; --size pixels), one with
--train-size training images and one ten times larger, and measures, for each --workers value:
- loader: samples/s that data.py's FolderData delivers (decoded, RandomResizedCrop + flip, collated and
  normalized, bad-file agreement included) in this process (one intra-op thread) with nothing else running;
- training: samples/s of ``python ddp_cifar100.py --dataset imagefolder --model resnet18`` (a world of one,
  OMP_NUM_THREADS=1 so that a loader worker can have the other core), from the trainer's median step time
  after warm-up, and the median time per step it waited for data;
- memory: resident (RSS), proportional (PSS: shared pages split between the processes that map them) and
  private memory of the main process and each loader worker after a pass over both folders, with
  torchvision's ImageFolder (a Python list of (path, class) tuples) beside ours for reference.
Where the time goes: per-sample decode and transform times measured in this process, the per-batch
normalization, and what the trainer's one all_reduce per micro-batch (agreeing on bad files) costs on 2
processes. The machine is shared: every ratio is taken within one run, and the load average is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import harness
import utils
from data import FolderData, folder_transforms, normalize
from benchmarks.make_image_folder import write_image_folder
from files import write_json
from measure.machine import child_pids, machine_info, machine_tag
from measure.memory import process_memory_mib
from measure.timing import time_calls_ms
from trainer.config import WARMUP_STEPS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root


def process_memory() -> dict[str, dict[str, float]]:
    """This process and its children (the loader workers), each with its RSS, PSS and private MiB."""
    pids = [os.getpid()] + child_pids(os.getpid())
    return {("main" if pid == os.getpid() else f"worker {i}"): process_memory_mib(pid)
            for i, pid in enumerate(pids)}


def folder_data(root: str, size: int, workers: int, batch_size: int) -> FolderData:
    return FolderData(root, "imagenet", size, workers, 0, batch_size, torch.device("cpu"),
                              torch.contiguous_format, None)


def loader_pass(root: str, size: int, workers: int, batch_size: int, batches: int) -> dict:
    """Samples/s over ``batches`` micro-batches after the first (worker start-up), and memory at the end."""
    data = folder_data(root, size, workers, batch_size)
    stream = data.train_batches(epoch=0, start=0)
    next(stream)
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    elapsed = time.perf_counter() - start
    memory = process_memory()
    stream.close()
    data.close()
    return {"samples_per_s": batches * batch_size / elapsed, "memory_mb": memory,
            "sample_list_bytes": int(data.train.paths.nbytes + data.train.labels.nbytes)}


def torchvision_imagefolder_memory(root: str, size: int, workers: int, batch_size: int, batches: int) -> dict:
    """The same pass through torchvision's ImageFolder (samples: a Python list of tuples), for comparison."""
    import torchvision

    train_transform, _ = folder_transforms("imagenet", size)
    dataset = torchvision.datasets.ImageFolder(os.path.join(root, "train"), train_transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    iterator = iter(loader)
    for _ in range(batches + 1):
        next(iterator)
    memory = process_memory()
    del iterator, loader
    return {"memory_mb": memory}


def where_the_time_goes(root: str, size: int, samples: int) -> dict:
    """Per-sample decode (PIL open + convert) and transform times, and per-batch normalization, in ms."""
    from PIL import Image

    data = folder_data(root, size, 0, 32)
    decode, transform = [], []
    for index in range(samples):
        t0 = time.perf_counter()
        with open(data.train.path(index), "rb") as f, Image.open(f) as image:
            image = image.convert("RGB")
        t1 = time.perf_counter()
        data.train.transform(image)
        t2 = time.perf_counter()
        decode.append((t1 - t0) * 1e3)
        transform.append((t2 - t1) * 1e3)
    batch = torch.stack([data.train[(0, i)][0] for i in range(32)])
    normalize_ms = time_calls_ms(lambda: normalize(batch, data.mean, data.std, torch.contiguous_format),
                                 torch.device("cpu"), iters=50)
    data.close()
    return {"decode_ms_per_sample": statistics.median(decode),
            "transform_ms_per_sample": statistics.median(transform),
            "normalize_ms_per_batch_of_32": statistics.median(normalize_ms)}


def agreement_cost(rank: int, world_size: int) -> float:
    """Median ms of the trainer's per-micro-batch agreement (one int64 all_reduce MAX, gloo) on ``world_size``."""
    flag = torch.tensor([-1], dtype=torch.int64)
    times = time_calls_ms(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX), torch.device("cpu"),
                          iters=300)
    return statistics.median(times)


def training_run(root: str, size: int, workers: int, batch_size: int, steps: int) -> dict:
    """One trainer run (a world of one); its median step time and data wait after warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics_path = os.path.join(tmp, "metrics.json")
        command = [sys.executable, os.path.join(HERE, "ddp_cifar100.py"), "--dataset", "imagefolder",
                   "--data-dir", root, "--device", "cpu", "--model", "resnet18", "--image-size", str(size),
                   "--batch-size", str(batch_size), "--workers", str(workers), "--max-steps", str(steps),
                   "--epochs", "1", "--metrics-out", metrics_path]
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=HERE,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(metrics_path) as f:
            metrics = json.load(f)
    step_ms = metrics["step_time_ms_median"]
    return {"samples_per_s": batch_size / step_ms * 1e3, "step_time_ms_median": step_ms,
            "data_wait_ms_median": metrics["data_wait_ms_median"], "steps_timed": len(metrics["step_times_ms"]),
            "command": " ".join(["OMP_NUM_THREADS=1", "python", *command[1:-2]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="0,1,2", help="comma-separated --workers values")
    parser.add_argument("--size", type=int, default=64, help="image side, pixels (files and crops)")
    parser.add_argument("--train-size", type=int, default=2000, help="the small folder; the large one has 10x")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loader-batches", type=int, default=30, help="micro-batches timed per loader pass")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per training run (3 are warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the workers values, alternating order")
    parser.add_argument("--json", default=os.path.join(HERE, "results", f"loader-{machine_tag()}.json"))
    args = parser.parse_args()
    workers_list = [int(w) for w in args.workers.split(",")]
    torch.set_num_threads(1)  # as the trainer runs here (OMP_NUM_THREADS=1): loader and normalization on one core
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"small": os.path.join(tmp, "small"), "large": os.path.join(tmp, "large")}
        for name, train_size in (("small", args.train_size), ("large", 10 * args.train_size)):
            write_image_folder(folders[name], classes=10, train_size=train_size, val_size=200, size=args.size,
                               image_format="jpg")
            print(f"wrote {name} folder: {train_size} training images of {args.size} px", flush=True)
        utils.init_distributed("cpu", "gloo")  # FolderData's batches are a rank's shard: a world of one here
        breakdown = where_the_time_goes(folders["small"], args.size, 200)
        loader = {w: [] for w in workers_list}
        training = {w: [] for w in workers_list}
        for repeat in range(args.repeats):
            order = workers_list if repeat % 2 == 0 else workers_list[::-1]
            for w in order:
                loader[w].append(loader_pass(folders["small"], args.size, w, args.batch_size, args.loader_batches))
                training[w].append(training_run(folders["small"], args.size, w, args.batch_size, args.steps))
                print(f"round {repeat + 1}, --workers {w}: loader {loader[w][-1]['samples_per_s']:.0f} samples/s, "
                      f"training {training[w][-1]['samples_per_s']:.1f} samples/s", flush=True)
        memory = {}
        for name, root in folders.items():
            memory[name] = {"ours": loader_pass(root, args.size, 2, args.batch_size, args.loader_batches),
                            "torchvision ImageFolder": torchvision_imagefolder_memory(
                                root, args.size, 2, args.batch_size, args.loader_batches)}
        utils.cleanup_distributed()
    with harness.LocalGroup(2) as group:
        agreement_ms = group.run(agreement_cost)[0]

    rows = []
    for w in workers_list:
        loader_rate = statistics.median(r["samples_per_s"] for r in loader[w])
        train_rate = statistics.median(r["samples_per_s"] for r in training[w])
        step_ms = statistics.median(r["step_time_ms_median"] for r in training[w])
        rows.append({"workers": w, "loader_samples_per_s": loader_rate, "training_samples_per_s": train_rate,
                     "loader_over_training": loader_rate / train_rate, "step_time_ms_median": step_ms,
                     "data_wait_ms_median": statistics.median(r["data_wait_ms_median"] for r in training[w]),
                     "runs": {"loader": loader[w], "training": training[w]}})
    print(f"\n{'workers':>7} {'loader/s':>9} {'train/s':>8} {'ratio':>6} {'step ms':>8} {'data wait ms':>12}")
    for r in rows:
        print(f"{r['workers']:>7} {r['loader_samples_per_s']:>9.0f} {r['training_samples_per_s']:>8.1f} "
              f"{r['loader_over_training']:>6.1f} {r['step_time_ms_median']:>8.0f} {r['data_wait_ms_median']:>12.1f}")
    print(f"\nper sample: decode {breakdown['decode_ms_per_sample']:.3f} ms, transform "
          f"{breakdown['transform_ms_per_sample']:.3f} ms; agreement all_reduce on 2 processes {agreement_ms:.3f} ms")
    print(f"\n{'folder':>6} {'pipeline':>24} {'process':>9} {'RSS MiB':>8} {'PSS MiB':>8} {'private MiB':>11}")
    for name in memory:
        for pipeline, result in memory[name].items():
            for process, m in result["memory_mb"].items():
                print(f"{name:>6} {pipeline:>24} {process:>9} {m['rss']:>8.1f} {m['pss']:>8.1f} {m['private']:>11.1f}")
    payload = {
        "benchmark": "loader", "machine": machine_info("cpu"),
        "command": " ".join(["python", "-m", "benchmarks.loader_benchmark", *sys.argv[1:]]),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "wall_time_s": time.perf_counter() - started,
        "settings": {"size": args.size, "batch_size": args.batch_size, "train_sizes": [args.train_size,
                     10 * args.train_size], "loader_batches": args.loader_batches, "steps": args.steps,
                     "warmup_steps": WARMUP_STEPS, "repeats": args.repeats, "model": "resnet18",
                     "image_format": "jpg", "augment": "imagenet"},
        "rows": rows, "breakdown": dict(breakdown, agreement_all_reduce_ms_2_processes=agreement_ms),
        "memory": memory,
    }
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
