"""The benchmarks and tools beyond the assignment's two (bn_benchmark.py and training_benchmark.py, at the root).

Run each from the repository's root as a module, e.g. ``python -m benchmarks.zero_benchmark --quick``: ``-m`` puts
the root on sys.path, so the scripts import the library (utils, zero, data, ...) as the tests do, with no sys.path
edits in them.

    allreduce_benchmark.py   allreduce.py's collectives against torch.distributed's (gloo): time, memory, accuracy
    compile_benchmark.py     eager against torch.compile: the SyncBatchNorm layer and the trainer's step
    loader_benchmark.py      the image-folder loader against the trainer's appetite; its memory per worker
    slowlink_benchmark.py    DDP against DiLoCo and its variants over a shaped (slow) loopback link
    zero_benchmark.py        ZeRO stages 0-3 against DDP, ZeroRedundancyOptimizer and FSDP2: memory, bytes, time
    make_image_folder.py     writes the synthetic set as an image folder (PNG or JPEG) for --dataset imagefolder

and what the benchmarks that run the whole trainer share (training_benchmark.py at the root among them):

    trainer_runs.py          one torchrun of ddp_cifar100.py, tried again if asked, and the metrics it writes
    trainer_traces.py        its --profile traces reduced to their named ranges, every rank in one Chrome trace
"""
