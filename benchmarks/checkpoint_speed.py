"""Checkpoint save and load: trainbus against safetensors alone, on the same tensors.

Usage: python -m benchmarks.checkpoint_speed [--jobs mlp,large] [--rounds N] [--dir DIR] [--threads N]

Jobs (a model after one AdamW step, so the optimizer holds both moments of every parameter):
  mlp    the crash-test MLP 256-1024-1024-10: 1.3M parameters, 16 MB with its AdamW state (21 rounds)
  large  MLP 256-4096-4096-4096-4096-10: 51M parameters, 617 MB with its AdamW state (9 rounds)
  many   300 layers 64-64: many small tensors (600 weights, 1,800 AdamW state tensors), 20 MB (9 rounds)
  tiny   an 8-16-4 MLP: checks the code path in a second; its timings mean nothing

Rows (wall-clock milliseconds: an fsync is time spent waiting, not computing):
  save_file + fsync          every tensor a checkpoint holds (weights, AdamW moments, RNG states) in one
                             safetensors file, fsynced once: the least a crash-safe write of them needs
  trainbus save_checkpoint   the checkpoint: 10 files written into a temporary directory and hashed as they are
                             written, fsynced, the directory renamed into place and its parent fsynced
  load_file                  that one file with safetensors; lazy: it maps the file and reads nothing yet
  load_file + into place     the same and every tensor copied into memory already in use: the weights into the model
                             (``load_state_dict``), the AdamW moments (and RNG states) into tensors allocated and
                             touched before the rounds. No hash: the least an unverified resume into a live
                             optimizer needs (issue 23's 148 ms baseline)
  load_file + model + state copied
                             the same, the weights copied into the model and the rest copied out of the mapped
                             file into fresh memory (as an optimizer that has not stepped yet needs it): an
                             unverified resume of a fresh process, whose moments must get memory of their own
  load_file + xxh3           the lazy load and one hash pass over the file: the least a verified load needs
  load_file + xxh3 + model   the same and the weights copied into the model (``load_state_dict``): the optimizer's
                             tensors stay views of the mapped file
  load_file + xxh3 + model + state copied
                             the same and the optimizer state copied out of the mapped file: what a resume
                             that must not pin the file (rotation may delete it) needs; HF's torch.load copies too
  trainbus load_checkpoint   every file checked against the manifest (size, hash), then model, optimizer, state,
                             plugins and RNG states restored; the optimizer's tensors in fresh memory of their own
  fresh: load_file + load_state_dict
                             a hand-written, unverified resume of a fresh process (issue 29's 160 ms): an engine
                             built (untimed) with a new model and an AdamW without state; the file loaded with
                             safetensors, ``model.load_state_dict``, ``optimizer.load_state_dict`` (whose
                             moments stay views of the mapped file: their bytes are read at the first step)
  fresh: trainbus load_checkpoint
                             trainbus's verified load into such a fresh engine
  fresh: ... + 1 step        each of the two, then one AdamW step (gradients set untimed): the baseline's moments
                             are read and copied out of the mapping there, page by page, as the step writes them

A round runs the saves, then the loads, each group in an order that alternates from round to round.
Before the loads every file is read once, untimed, so that loads time the work of loading from the
page cache, not the disk (trainbus asks the kernel to drop a checkpoint's pages once they are
written). After the round, what it wrote is deleted and ``os.sync()`` runs, untimed, so the file
system's work for the deletions falls on no timed fsync. Printed per row: the median time, and the
median over rounds of each round's ratio to a baseline with the interquartile range of those ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import itertools
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch as st
import torch
import xxhash

from benchmarks.common import print_table
from trainbus.engine import Engine
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from trainbus.plugins.checkpoints.codec import join_tensors, split_tensors

#: name -> (layer widths, default rounds)
JOBS: dict[str, tuple[tuple[int, ...], int]] = {
    "mlp": ((256, 1024, 1024, 10), 21),
    "large": ((256, 4096, 4096, 4096, 4096, 10), 9),
    "many": ((64,) * 301, 9),
    "tiny": ((8, 16, 4), 3),
}
SAVE_BASE, SAVE = "save_file + fsync", "trainbus save_checkpoint"
LOAD_LAZY, LOAD_HASHED, LOAD_RESUME = "load_file", "load_file + xxh3", "load_file + xxh3 + model"
LOAD_COPIED = "load_file + xxh3 + model + state copied"
LOAD_IN_PLACE = "load_file + into place"
LOAD_FRESH = "load_file + model + state copied"
LOAD = "trainbus load_checkpoint"
FRESH_BASE, FRESH = "fresh: load_file + load_state_dict", "fresh: trainbus load_checkpoint"
FRESH_BASE_STEP, FRESH_STEP = f"{FRESH_BASE} + 1 step", f"{FRESH} + 1 step"
#: row -> the baselines its ratios are taken against
AGAINST: dict[str, tuple[str, ...]] = {
    SAVE_BASE: (),
    SAVE: (SAVE_BASE,),
    LOAD_LAZY: (),
    LOAD_IN_PLACE: (LOAD_LAZY,),
    LOAD_FRESH: (LOAD_IN_PLACE,),
    LOAD_HASHED: (LOAD_LAZY,),
    LOAD_RESUME: (LOAD_LAZY,),
    LOAD_COPIED: (LOAD_LAZY,),
    LOAD: (LOAD_IN_PLACE, LOAD_FRESH, LOAD_COPIED, LOAD_RESUME, LOAD_HASHED, LOAD_LAZY),
    FRESH_BASE: (),
    FRESH: (FRESH_BASE,),
    FRESH_BASE_STEP: (),
    FRESH_STEP: (FRESH_BASE_STEP,),
}


def make_engine(widths: tuple[int, ...]) -> Engine:
    """An MLP of ``widths`` after one AdamW step on one batch."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    batch = (torch.randn(4, widths[0]), torch.randint(0, widths[-1], (4,)))
    engine = Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        train_data=[batch],
        max_steps=1,
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    engine.fit()
    return engine


def fresh_engine(widths: tuple[int, ...], grads: bool) -> Engine:
    """A resumed process's engine before the load: a new model and an AdamW without state (gradients set)."""
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3) if grads else None
    batch = (torch.randn(4, widths[0]), torch.randint(0, widths[-1], (4,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Engine(model, optimizer, train_data=[batch], max_steps=1, loss_fn=torch.nn.CrossEntropyLoss())


def fresh_rows(
    widths: tuple[int, ...], single: Path, checkpoint: Path, optimizer: Any, weight_names: list[str]
) -> tuple[list[tuple[str, Callable[[], Any]]], list[Engine]]:
    """The fresh-resume rows, each restoring into an engine of its own built here (untimed), and those engines."""
    stepping = (FRESH_BASE_STEP, FRESH_STEP)
    engines = {row: fresh_engine(widths, grads=row in stepping) for row in (FRESH_BASE, FRESH, *stepping)}

    def hand_written(engine: Engine, step: bool) -> None:
        assert engine.optimizer is not None
        loaded = st.load_file(str(single))
        engine.model.load_state_dict({name: loaded[name] for name in weight_names})
        engine.optimizer.load_state_dict(join_tensors(optimizer, loaded, str(single)))
        if step:
            engine.optimizer.step()

    def verified(engine: Engine, step: bool) -> None:
        assert engine.optimizer is not None
        load_checkpoint(engine, checkpoint)
        if step:
            engine.optimizer.step()

    rows = [
        (FRESH_BASE, lambda: hand_written(engines[FRESH_BASE], False)),
        (FRESH, lambda: verified(engines[FRESH], False)),
        (FRESH_BASE_STEP, lambda: hand_written(engines[FRESH_BASE_STEP], True)),
        (FRESH_STEP, lambda: verified(engines[FRESH_STEP], True)),
    ]
    return rows, list(engines.values())


def checkpoint_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """Every tensor a trainbus checkpoint of ``engine`` holds, in one flat dict."""
    assert engine.optimizer is not None
    tensors = dict(engine.model.state_dict())
    tensors.update(split_tensors(engine.optimizer.state_dict(), "optimizer")[1])
    tensors.update(split_tensors(cio.rng_state(), "rng")[1])
    return tensors


def run_job(widths: tuple[int, ...], rounds: int, directory: Path) -> tuple[dict[str, list[float]], int]:
    """Seconds per row and round, and the bytes of tensors a checkpoint holds."""
    engine = make_engine(widths)
    target = make_engine(widths)  # what the loads restore into
    tensors = checkpoint_tensors(engine)
    assert engine.optimizer is not None
    structure = split_tensors(engine.optimizer.state_dict(), "optimizer")[0]  # what the hand-written resume joins
    weight_names = list(target.model.state_dict())
    # where the in-place baseline copies the rest: memory allocated and touched once, untimed
    places = {name: tensor.clone() for name, tensor in tensors.items() if name not in weight_names}
    times: dict[str, list[float]] = {row: [] for row in AGAINST}
    for round_ in range(rounds):
        single = directory / f"single-{round_}.safetensors"
        engine.state.global_step = round_ + 1
        written: list[Path] = []
        kept: list[Any] = []

        def save_base() -> None:
            st.save_file(tensors, str(single))
            _fsync(single)

        def resume_base(copy_state: bool = False, hashed: bool = True) -> None:
            if hashed:
                _xxh3_of(single)
            loaded = st.load_file(str(single))
            target.model.load_state_dict({name: loaded[name] for name in weight_names})
            if copy_state:  # the optimizer's moments in memory of their own, not views of the mapped file
                kept.append({name: t.clone() for name, t in loaded.items() if name not in weight_names})

        def in_place() -> None:
            loaded = st.load_file(str(single))
            target.model.load_state_dict({name: loaded[name] for name in weight_names})
            for name, place in places.items():
                place.copy_(loaded[name])

        saves: list[tuple[str, Callable[[], Any]]] = [
            (SAVE_BASE, save_base),
            (SAVE, lambda: written.append(save_checkpoint(engine, directory))),
        ]
        loads: list[tuple[str, Callable[[], Any]]] = [
            (LOAD_LAZY, lambda: st.load_file(str(single))),
            (LOAD_IN_PLACE, in_place),
            (LOAD_FRESH, lambda: resume_base(copy_state=True, hashed=False)),
            (LOAD_HASHED, lambda: (_xxh3_of(single), st.load_file(str(single)))),
            (LOAD_RESUME, resume_base),
            (LOAD_COPIED, lambda: resume_base(copy_state=True)),
            (LOAD, lambda: load_checkpoint(target, written[0])),
        ]
        _timed(saves, round_, times)
        for path in [single, *written[0].iterdir()]:
            _xxh3_of(path)  # into the page cache
        _reset(target)
        fresh, engines = fresh_rows(widths, single, written[0], structure, weight_names)
        _timed(loads + fresh, round_, times)
        kept.clear()  # the baseline's copies, freed untimed
        engines.clear()  # before the files they may map are deleted
        for name, tensor in target.model.state_dict().items():  # the last loads restored what was saved
            assert torch.equal(tensor, engine.model.state_dict()[name]), name
        _reset(target)
        shutil.rmtree(written[0])
        single.unlink()
        os.sync()
    return times, sum(t.numel() * t.element_size() for t in tensors.values())


_LIBC = ctypes.util.find_library("c")


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc), untimed.

    Otherwise the first row of a round to allocate gets pages the rows before it freed, already
    mapped, and the others page-fault their copies in: per-round ratios then depend on the order
    of the rows (measured: trainbus load_checkpoint 1.06x 'state copied' when it ran first, 1.50x
    when last) and their median on which mode the middle round fell in.
    """
    trim = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


def _timed(runs: list[tuple[str, Callable[[], Any]]], round_: int, times: dict[str, list[float]]) -> None:
    for row, run in runs if round_ % 2 == 0 else runs[::-1]:
        _trim_heap()
        start = time.perf_counter()
        run()
        times[row].append(time.perf_counter() - start)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _xxh3_of(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128().hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128(view).hexdigest()


def _reset(engine: Engine) -> None:
    """Zero the weights and start a fresh optimizer, untimed.

    A loaded optimizer state is backed by the file it came from (safetensors maps it): dropping it
    after the file is deleted would free the file's blocks inside the next timed load.
    """
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.zero_()
    engine.optimizer = torch.optim.AdamW(engine.model.parameters(), lr=1e-3)


def table(times: dict[str, list[float]]) -> list[list[str]]:
    """Per row: its name, the median ms, and its median ratio (with IQR) to each of its baselines."""
    rows = []
    for row, baselines in AGAINST.items():
        ratios = []
        for base in baselines:
            per_round = [a / b for a, b in zip(times[row], times[base])]
            spread = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
            ratios.append(f"{statistics.median(per_round):.2f}x {base} (IQR {spread[2] - spread[0]:.2f})")
        rows.append([row, f"{statistics.median(times[row]) * 1e3:.2f}", "; ".join(ratios) or "baseline"])
    return rows


def _shape(widths: tuple[int, ...]) -> str:
    if len(widths) <= 8:
        return "-".join(map(str, widths))
    return f"{widths[0]}-...-{widths[-1]} ({len(widths) - 1} layers)"


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="mlp,large", help=f"comma-separated, of {', '.join(JOBS)}")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per job (default: the job's own)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (copies into the model use them)")
    args = parser.parse_args(argv)
    names = [name for name in args.jobs.split(",") if name]
    unknown = sorted(set(names) - set(JOBS))
    if unknown:
        parser.error(f"unknown jobs {unknown}; known: {', '.join(JOBS)}")
    torch.set_num_threads(args.threads)  # 2 threads on a busy 2-core machine made a 5 MB copy_ take 30 ms
    results = {}
    for name in names:
        widths, default_rounds = JOBS[name]
        rounds = args.rounds or default_rounds
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-speed-") as directory:
            results[name], nbytes = run_job(widths, rounds, Path(directory))
        parameters = sum(fan_in * fan_out + fan_out for fan_in, fan_out in itertools.pairwise(widths))
        print_table(
            f"{name}: MLP {_shape(widths)}, {parameters / 1e6:.2f}M parameters, "
            f"{nbytes / 1e6:.1f} MB of tensors with AdamW state; {rounds} rounds",
            ["row", "median ms", "median ratio over rounds"],
            table(results[name]),
        )
    return results


if __name__ == "__main__":
    main()
