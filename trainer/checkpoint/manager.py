"""The run's checkpointer: ``Checkpointer`` saves and restores on every rank, over the run's parts as objects with
state_dict() / load_state_dict() (torchtitan's CheckpointManager), and owns what lives as long as the run: the
folder's lock, the format (``folders``: DCP folders or last.pt), the background writer (--async-checkpoint), the
loop's stall in each save and the run's end's wait for its last.

The model and the optimizer are written and read by the sync itself (every sync's ``save_checkpoint`` /
``load_checkpoint``: zero.checkpoint.Checkpoints), the run state beside them as last.pt's other keys or the folder's
extra, so nothing here asks which sync runs.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import utils
import zero
from measure.memory import PhasePeaks, measured_phase
from trainer.checkpoint import folders
from trainer.checkpoint.folders import FILE, FOLDER, PARTIAL, Found
from trainer.checkpoint.reading import READ_ATTEMPTS, non_finite, read_state, usage_error
from trainer.checkpoint.run_state import NO_SUMS, Position, RunState, check_compatible, trajectory
from trainer.config import Config
from trainer.faults import FaultPlan
from utils import UsageError, one_line

MARKER_WAIT_S = 2.0  # how long a rank looks for rank 0's marker (a network file system may show it late)


class Superseded(UsageError):
    """Rank 0's read of the run state failed as the checkpoint it read was superseded (read_whole reads again)."""


class NoState:
    """A part the run does not have (no --scheduler): None in the checkpoint, nothing to load."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class Checkpointer:
    """Saves and restores the run: ``sync`` (the model, which it wraps, and ``optimizer``, which it writes and reads
    in either format), ``states`` (the scheduler, the scaler: each saved under its name) and ``run`` (the position,
    the finished epochs, the epoch's sums, the run's record and fingerprint: RunState). Every rank makes one and
    calls it. ``phases``: the run's PhasePeaks (restore and save end theirs: measure.memory.measured_phase)."""

    def __init__(self, config: Config, sync: Any, optimizer: Any, states: dict[str, Any], run: RunState,
                 comm_device: torch.device, phases: PhasePeaks, faults: FaultPlan = FaultPlan()):
        self.config, self.directory = config, config.checkpoint_dir
        self.faults = faults  # trainer/faults.py's: a save's points "write" and "save"
        self.sync, self.optimizer, self.states, self.run = sync, optimizer, states, run
        self.comm_device, self.phases = comm_device, phases
        self.rank = run.rank  # this process's rank in the run (its world's: utils.DistContext)
        self.saves_folders = False  # what save writes: DCP folders, or last.pt (restore decides)
        self.lock: int | None = None  # rank 0's lock on the folder for the run's life (folders.lock)
        self.writer: Any = None  # --async-checkpoint: zero.checkpoint.AsyncWriter (restore makes it)
        self.stalls: list[float] = []  # seconds the loop spent in each save
        self.final_wait = 0.0  # --async-checkpoint: seconds the run's end waited for its last save
        self.subscribers: list[Callable[[int], None]] = []  # when_published's: told each checkpoint's step once current
        self.checks: list[Callable[[], None]] = []  # before_saving's: each may refuse the save (raise)

    @classmethod
    def of(cls, parts: Any) -> Checkpointer:
        """The checkpointer of the run ``parts`` (trainer.build.Parts) describes."""
        record = trajectory(parts.config, parts.data, parts.schedule_steps)
        run = RunState(parts.config, record, parts.ctx.world_size, parts.ctx.rank)
        states = {"scheduler": parts.scheduler if parts.scheduler is not None else NoState(), "scaler": parts.scaler}
        return cls(parts.config, parts.sync, parts.optimizer, states, run, parts.comm_device, parts.phases,
                   parts.faults)

    @property
    def fingerprint(self) -> str:
        """The run's fingerprint (run_state.fingerprint of its trajectory): what a checkpoint must carry to resume
        it, and what replica groups share."""
        return self.run.fingerprint

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beside the model and the optimizer: last.pt's other keys, a folder's extra."""
        return {**{name: part.state_dict() for name, part in self.states.items()}, **self.run.state_dict()}

    def when_published(self, subscriber: Callable[[int], None]) -> None:
        """``subscriber(step)`` once each checkpoint saved from now on is current (on every rank; with
        --async-checkpoint, in the writer's thread): replica groups say which step a restart brings back."""
        self.subscribers.append(subscriber)

    def before_saving(self, check: Callable[[], None]) -> None:
        """``check()`` on every rank before each save, which it stops by raising (trainer/finite.py: nothing
        non-finite is saved)."""
        self.checks.append(check)

    # ------------------------------------------------------------------------------------------------------
    # Restore
    # ------------------------------------------------------------------------------------------------------
    @measured_phase("restore")
    def restore(self) -> tuple[Position, list[dict[str, Any]], list[float]]:
        """The position, the finished epochs and this rank's sums of the current epoch, from --checkpoint-dir's
        current checkpoint if there is one (with --eval-only: its weights and totals alone); and which format this
        run saves. Position and the epochs' list are the run state's own: the loop changes them in place, and a save
        writes them as they are."""
        config, run = self.config, self.run
        if self.directory is None:
            return run.position, run.history, list(NO_SUMS)
        if not config.eval_only:  # a reader (--eval-only) needs no lock
            self.take_lock()
        self.saves_folders = self.writes_folders()
        if config.async_checkpoint and not config.eval_only:
            self.writer = zero.checkpoint.AsyncWriter()
        loaded = self.read_whole() if config.eval_only else self.load_on_rank0()
        if loaded is None:
            return run.position, run.history, list(NO_SUMS)
        found, state = loaded[:2]
        if not config.eval_only:
            check_compatible(state, run.record, found.path, config, run.world_size)
            self.load_model(found, state["optimizer_steps"])
        run.load_totals(state)
        if config.eval_only:
            return run.position, run.history, list(NO_SUMS)
        for name, part in self.states.items():
            part.load_state_dict(state[name])
        run.load_state_dict(state)
        utils.print0(f"resuming from {found.path}: epoch {run.position.epoch + 1}, micro-batch "
                     f"{run.position.micro_batch}, optimizer step {run.position.optimizer_steps}")
        return run.position, run.history, run.my_sums()

    def take_lock(self) -> None:
        """Rank 0 locks the folder for the run's life (folders.lock); a second run on it, or a folder this run
        cannot write in, refused in one line on every rank before anything is touched."""
        message = [None]
        if self.rank == 0:
            self.lock, message[0] = folders.lock(self.directory)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(message, src=0)
        if message[0] is not None:
            raise UsageError(message[0])

    def writes_folders(self) -> bool:
        """Whether this run saves DCP folders (the package's docstring): a sync that holds shards, and every rank
        sees the folder rank 0 sees (else last.pt, said once). Rank 0 first removes what a save cut short left
        (DIR/step-N.partial), before any rank can write a folder of that name."""
        if self.config.eval_only or not self.sync.holds_shards:
            return False
        if self.rank == 0:
            folders.remove_leftovers(self.directory)
        if self.seen_by_every_rank():
            return True
        ignored = (f"; --keep-checkpoints {self.config.keep_checkpoints} does not apply (one file)"
                   if self.config.keep_checkpoints > 1 else "")
        utils.print0(f"note: not every rank sees --checkpoint-dir {self.directory} (no shared file system): rank "
                     f"0 writes {FILE} there, the model and the optimizer gathered to it{ignored}")
        return False

    def seen_by_every_rank(self) -> bool:
        """Whether every rank sees the folder as rank 0 does (one machine, or a shared file system): rank 0 leaves a
        marker of a name of its own there, the others look for it, and all agree (one broadcast, one all-reduce)."""
        if dist.get_world_size() == 1:
            return True
        rank, message = dist.get_rank(), [None]
        if rank == 0:
            try:
                message[0] = ("ok", folders.seen_marker(self.directory))
            except OSError as exc:
                message[0] = ("error", f"cannot write in --checkpoint-dir {self.directory}: {exc.strerror or exc}")
        dist.broadcast_object_list(message, src=0)
        status, text = message[0]
        if status == "error":
            raise UsageError(text)
        marker = os.path.join(self.directory, text)
        deadline = time.monotonic() + MARKER_WAIT_S
        while rank != 0 and not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = torch.tensor([int(os.path.exists(marker))], device=self.comm_device)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        if rank == 0:
            os.remove(marker)
        return bool(seen.item())

    def read_whole(self) -> tuple[Found, dict[str, Any], Any] | None:
        """--eval-only, a reader beside a run that may be saving into the folder: the current checkpoint read whole
        (its run state and the sync's weights), or, where the run supersedes it while it is read (a folder renamed
        .removing and deleted, last.pt replaced), the newer one, read again from the start (READ_ATTEMPTS times at
        most). Whole: the path names the same file or folder (folders.identity) after every rank's read as before
        rank 0's first, and no rank failed; every rank agrees (one all_gather_object per attempt)."""
        for _ in range(READ_ATTEMPTS):
            problem, loaded, same = None, None, True
            try:
                loaded = self.load_on_rank0()
                if loaded is not None:
                    with folders.opened(loaded[0], loaded[2]) as path:  # last.pt: the very file rank 0 read
                        same = path is not None
                        if same:
                            self.load_model(Found(path, loaded[0].folder), loaded[1]["optimizer_steps"])
            except Superseded:
                continue  # every rank alike (rank 0's verdict, broadcast)
            except Exception as exc:  # noqa: BLE001 - said below, once every rank knows whether to read again
                problem = str(exc) if isinstance(exc, UsageError) else one_line(exc)
            same = same and (loaded is None or folders.identity(loaded[0].path) == loaded[2] or not loaded[0].folder)
            verdicts: list[Any] = [(problem, same)]
            if dist.get_world_size() > 1:
                verdicts = [None] * dist.get_world_size()
                dist.all_gather_object(verdicts, (problem, same))
            if all(same for _, same in verdicts):
                first = next((problem for problem, _ in verdicts if problem), None)
                if first is not None:
                    raise UsageError(first)
                return loaded
        raise UsageError(f"cannot read --checkpoint-dir {self.directory}: a run superseded its checkpoint while it "
                         f"was read, {READ_ATTEMPTS} times")

    def load_on_rank0(self) -> tuple[Found, dict[str, Any], Any] | None:
        """Rank 0 finds the current checkpoint, reads its run state (reading.read_state) and broadcasts both, so that
        every rank checks the same thing, and other nodes need not see last.pt; and what the path named as it began
        to read (folders.identity: read_whole's check)."""
        message: list[Any] = [None]
        if dist.get_rank() == 0:
            found, before = None, None
            try:
                found = folders.current(self.directory)
                if found is not None and found.note:
                    print(found.note, flush=True)
                before = folders.identity(found.path) if found else None
                with folders.opened(found, before) as path:  # last.pt: the file, not its name (read_whole)
                    message[0] = ("ok", found, before, read_state(Found(path, found.folder))) if found else None
            except Exception as exc:  # noqa: BLE001 - said in one line on every rank, none left waiting for rank 0
                text = str(exc) if isinstance(exc, UsageError) else (f"cannot read --checkpoint-dir {self.directory}: "
                                                                      f"{one_line(exc)}")
                gone = found is not None and (before is None or folders.identity(found.path) != before)
                message[0] = ("superseded" if gone else "error", text)  # gone: read_whole reads the newer one
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return None
        if message[0][0] == "superseded":
            raise Superseded(message[0][1])
        if message[0][0] == "error":
            raise UsageError(message[0][1])
        _, found, identity, state = message[0]
        return found, state, identity

    def load_model(self, found: Found, optimizer_steps: int) -> None:
        """The sync reads its model and optimizer from ``found`` (the weights alone with --eval-only), either format
        at any world size; a checkpoint it cannot read refused in one line. Under fp16 the scaler may have skipped
        every step, and left some parameters without state (``stepped``)."""
        eval_only = self.config.eval_only
        stepped = optimizer_steps > 0 and self.config.amp != "fp16"
        # imported here, not at the top: DCP (and DTensor under it) is 1.4 s of every launched process's start
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            self.sync.load_checkpoint(found.path, None if eval_only else self.optimizer, stepped=stepped)
        except (zero.checkpoint.CheckpointError, CheckpointException) as exc:
            raise usage_error(exc, found.path) from None
        # a non-finite weight (one a run saved before trainer/finite.py stopped such runs) refused, on every rank:
        # the model's tensors this rank holds (--zero 3's gathered ones are freed: skipped), and the optimizer's
        # parameters (--zero 1-3: this rank's shards)
        module = self.sync.module
        held = [(name.removeprefix("module."), tensor) for name, tensor in
                [*module.named_parameters(), *module.named_buffers()] if holds_data(tensor)]
        shards = [(f"(a shard of rank {self.rank}'s parameters, group {i})", p)
                  for i, group in enumerate(getattr(self.optimizer, "param_groups", [])) for p in group["params"]
                  if holds_data(p)]
        problem = non_finite([*held, *shards])
        if dist.get_world_size() > 1:
            from zero.checkpoint import agree
            problem = agree(problem, None, split=True)
        if problem is not None:
            raise UsageError(f"checkpoint {found.path}: {problem}")

    # ------------------------------------------------------------------------------------------------------
    # Save
    # ------------------------------------------------------------------------------------------------------
    @measured_phase("checkpoint")
    def save(self, sums: list[list[float]]) -> None:
        """The run state as it stands (the position and the finished epochs restore returned, every rank's epoch
        sums ``sums``) to --checkpoint-dir, in the format restore chose. Every rank calls it. With --async-checkpoint
        it returns once this rank's state is staged (after the previous save is written and published: one save in
        flight); the time the loop spends here is the save's stall, in the metrics' checkpoint_stalls_s."""
        if self.directory is None:
            return
        for check in self.checks:
            check()
        start = time.perf_counter()
        self.wait_for_saves()
        self.run.sums = sums
        state = self.state_dict()
        if self.saves_folders:
            self.save_folder(state)
        else:
            self.save_file(state)
        if self.rank == 0:  # trained again: no longer left behind its run's end ([Note: left behind] in folders.py)
            folders.clear_behind(self.directory)
        self.stalls.append(time.perf_counter() - start)

    def save_folder(self, state: dict[str, Any]) -> None:
        """DIR/step-N: every rank writes its own shards into DIR/step-N.partial (the sync's save_checkpoint),
        ``state`` as rank 0's extra; then rank 0 makes it current (folders.make_current)."""
        directory, name = self.directory, f"{FOLDER}{state['optimizer_steps']}"
        path = os.path.join(directory, name + PARTIAL)
        self.write_then_publish(state, name,
                                lambda writer: self.sync.save_checkpoint(path, self.optimizer, state, writer=writer),
                                lambda: folders.make_current(directory, name, self.config.keep_checkpoints))

    def save_file(self, state: dict[str, Any]) -> None:
        """DIR/last.pt, written by rank 0: the model and the optimizer's state in the form every --zero and world
        size loads (the sharded syncs gather them to rank 0, so every rank calls this), and ``state``; then what it
        supersedes removed (folders.forget_folders)."""
        path = os.path.join(self.directory, FILE)
        self.write_then_publish(state, FILE,
                                lambda writer: self.sync.save_checkpoint(path, self.optimizer, state, one_file=True,
                                                                         writer=writer),
                                lambda: folders.forget_folders(self.directory))

    def write_then_publish(self, state: dict[str, Any], name: str, write: Callable[[Any], Any],
                           publish: Callable[[], None]) -> None:
        """A save of DIR/``name``: ``write(writer)`` (every rank), the fault point "save" (written, not yet current),
        then rank 0's ``publish``. The disk's error on the way is refused on every rank (``settle``). With
        --async-checkpoint all of it after the copy happens in the writer's thread (``in_background``)."""
        if self.writer is not None:
            self.in_background(state, write, publish)
            return
        problem = disk_error(lambda: write(None))
        if problem is None:
            self.faults.at("save", state["optimizer_steps"])
        if problem is None and self.rank == 0:  # DCP's save returns once every rank's data and the .metadata are
            problem = disk_error(publish)  # written
        self.settle(name, problem)
        for subscriber in self.subscribers:
            subscriber(state["optimizer_steps"])

    def settle(self, name: str, problem: str | None) -> None:
        """After a save of DIR/``name``, every rank: a disk's error that stopped it, on any rank, refused on every
        rank in one line naming the checkpoint that stays current. Rank 0 first removes what the save left
        (folders.failed_save_note), so the previous checkpoint, untouched, is still the one a resume reads."""
        from zero.checkpoint import agree
        if problem is not None and self.rank == 0:
            problem += folders.failed_save_note(self.directory, name)
        problem = agree(problem, None, split=True) if dist.get_world_size() > 1 else problem
        if problem is not None:
            raise UsageError(f"cannot save checkpoint {os.path.join(self.directory, name)}: {problem}")

    # ------------------------------------------------------------------------------------------------------
    # Saves in the background (--async-checkpoint)
    # ------------------------------------------------------------------------------------------------------
    def in_background(self, state: dict[str, Any], write: Callable[[Any], Any], publish: Callable[[], None]) -> None:
        """``write(writer)`` copies this rank's state into the writer's staging buffers and hands the write to its
        thread, which passes the fault point "write" first (trainer/faults.py); after the write, in the thread and
        only if it succeeded, the fault point "save" (written, not yet current) and rank 0's ``publish``. A failure
        stops every rank at the same step soon after, or at the next save, in one line (``failed``,
        ``wait_for_saves``); the save's
        DIR/step-N.partial is then left for the next start to remove."""
        rank, step, faults = self.rank, state["optimizer_steps"], self.faults
        writer = self.writer
        writer.before_write = lambda: faults.at("write", step)
        write(writer)

        def published() -> None:
            faults.at("save", step)
            if rank == 0:
                publish()
            for subscriber in self.subscribers:
                subscriber(step)
        writer.then(published)

    def failed(self) -> bool:
        """--async-checkpoint: whether this rank's background save failed. The loop's per-step all-reduce
        (trainer/finite.py's ``watch``) tells every rank, which then all call ``wait_for_saves``: one line, from rank 0,
        the previous checkpoint still current."""
        return self.writer is not None and self.writer.error() is not None

    def wait_for_saves(self) -> None:
        """--async-checkpoint: the save in flight written and published on every rank before the next one (or the
        run's end, or a failure one rank saw: ``failed``); a failure on any rank said on all in one line (one
        all_gather_object)."""
        if self.writer is None:
            return
        problem = None
        try:
            self.writer.wait()
        except zero.checkpoint.CheckpointError as exc:
            problem = str(self.background_failure(exc))
        if dist.get_world_size() > 1:
            from zero.checkpoint import agree
            problem = agree(problem, None)
        if problem:
            raise UsageError(problem)

    def background_failure(self, exc: Exception) -> UsageError:
        why = usage_error(exc, self.directory)  # zero.checkpoint's refusal without its prefix
        return UsageError(f"the background save into --checkpoint-dir {self.directory} failed: {why} (the checkpoint "
                          f"before it is still current)")

    # ------------------------------------------------------------------------------------------------------
    # The run's end
    # ------------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """The run's end: its last save written (the wait counted in checkpoint_final_wait_s) and the writer
        stopped."""
        if self.writer is None:
            return
        start = time.perf_counter()
        self.wait_for_saves()
        self.writer.close()
        self.writer = None
        self.final_wait = time.perf_counter() - start

    def close(self) -> None:
        """Whatever ended the run: a writer still there (a run stopped by an error) left as it is (its folder stays
        .partial, removed at the next start; the previous checkpoint is current), and the folder's lock released
        (in-process callers may start another run on it)."""
        if self.writer is not None:
            self.writer.close(wait=False)
            self.writer = None
        folders.unlock(self.lock)
        self.lock = None


def holds_data(tensor: torch.Tensor) -> bool:
    """Whether a tensor's storage holds its elements (--zero 3 frees a gathered unit's: resized to nothing)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.device.type != "meta" and local.untyped_storage().nbytes() >= local.numel() * local.element_size()


def disk_error(write: Callable[[], Any]) -> str | None:
    """``write()``, and the disk's error it raised in words (a full disk, a quota, a read-only or unwritable
    folder: zero/checkpoint/disk.py), or None; any other error raised as it is."""
    from zero.checkpoint import disk_problem
    try:
        write()
    except Exception as exc:
        problem = disk_problem(exc)
        if problem is None:
            raise
        return problem
    return None
