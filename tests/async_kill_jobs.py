"""Kill trials of asynchronous checkpoints (#36 item 3): the child run, and the parent's side of a trial.

Used by tests/test_async_checkpoint_kills.py and benchmarks/async_kill_trials.py. The child (``child(opts)``, a
process forked from a forkserver that imported torch and trainbus once) trains a dropout MLP (0.3M parameters,
AdamW: a 3.6 MB checkpoint) with ``save_async=True``, a save every ``SAVE_STEPS``, ``save_total_limit=2``, as an
Engine (Checkpointing + Preemption) or a Trainer, and logs what its writer does to an events file (``start N`` /
``end N`` around ``PendingCheckpoint.write``; with ``slow`` each phase, slowed; with ``hold`` it stops in one), so
that the parent (``kill_trial``) signals it during a write, checks what it left, resumes it from True and compares
the end with an uninterrupted synchronous run (``reference``). The slowing lives in the child only.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_STEPS = 24
SAVE_STEPS = 3
SLOW = 0.008  # seconds added to each phase of a background write (about 10 phases: a write of ~0.1 s)
PACE = 0.01  # seconds added to each training step (training goes on while the writer writes)
TIMEOUT = 120


# -- the child --------------------------------------------------------------------------------------
class Events:
    """Appends ``<monotonic> <what>`` lines; O_APPEND writes of one line each, unbuffered (a SIGKILL loses none).

    ``hold``: ``[step, text, seconds]``: in the write of checkpoint ``step``, at the first event containing ``text``,
    log ``holding`` and sleep ``seconds`` there (in the writer thread): the parent's signal then lands in that phase.
    """

    def __init__(self, path: str, hold: list[Any] | None = None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.hold = hold
        self.writing: int | None = None  # the step of the write in flight (set by the writer thread)

    def __call__(self, what: str) -> None:
        if what.startswith("start "):
            self.writing = int(what.split()[1])
        os.write(self.fd, f"{time.monotonic():.6f} {what}\n".encode())
        hold = self.hold
        if hold is not None and self.writing == hold[0] and hold[1] in what:
            self.hold = None
            self(f"holding {what}")
            time.sleep(hold[2])


def _slowed(log: Events, slow: float) -> None:
    """Each phase of a write logged, then slowed by ``slow`` seconds (the module attributes the checkpoint code
    looks up at call time): the tensor files, the fsync, the rename, the rotation and each removal."""
    from trainbus.plugins.checkpoints import checkpoint, directory, writing
    from trainbus.plugins.checkpoints import io as cio

    def slowed(fn: Any, label: Any, after: str = "") -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            log(label(*args))
            time.sleep(slow)
            result = fn(*args, **kwargs)
            if after:
                log(after)
            return result

        return wrapped

    cio.write_tensors = slowed(cio.write_tensors, lambda path, _: f"file {path.parent.name}/{path.name}")
    cio.sync_files = slowed(cio.sync_files, lambda *_: "sync")
    writing.publish_directory = slowed(writing.publish_directory, lambda _, final: f"publish {final.name}", "published")
    checkpoint.rotate_checkpoints = slowed(checkpoint.rotate_checkpoints, lambda *_: "rotate", "rotated")
    directory._remove = slowed(directory._remove, lambda path: f"remove {path.name}")


def _logged_writes(log: Events, fsize: list[int]) -> None:
    """``start N`` / ``end N`` (``fail N``) around each write, ``waiting`` when the training thread waits for one.
    From the write of checkpoint ``fsize[0]`` on, no file may grow past ``fsize[1]`` bytes, as on a full disk."""
    from trainbus.plugins.checkpoints import background, writing

    original, wait = writing.PendingCheckpoint.write, background.BackgroundWriter.wait

    def logged_wait(self: Any, *args: Any, **kwargs: Any) -> float:
        if self.busy:
            log("waiting")
        return wait(self, *args, **kwargs)  # type: ignore[no-any-return]

    def write(self: Any) -> Path:
        log(f"start {(step := self.final.name.split('-')[-1])}")
        if int(step) == fsize[0]:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize[1], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            final = original(self)
        except BaseException as exc:
            log(f"fail {step} {type(exc).__name__}")
            raise
        log(f"end {step}")
        return final

    writing.PendingCheckpoint.write, background.BackgroundWriter.wait = write, logged_wait  # type: ignore[method-assign]


def _model() -> Any:
    import torch

    class Wide(torch.nn.Module):
        """A dropout MLP with an HF-style forward (a dict with the loss when there are labels)."""

        def __init__(self) -> None:
            super().__init__()
            nn = torch.nn
            self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                                     nn.Linear(512, 16))  # fmt: skip

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            out = self.net(x)
            if labels is None:
                return out
            return {"logits": out, "loss": torch.nn.functional.mse_loss(out, labels)}

    torch.manual_seed(0)
    return Wide()


def _data(n: int = 128) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 64, generator=g), torch.randn(n, 16, generator=g)


def _engine(opts: dict[str, Any]) -> Any:
    import torch

    from trainbus.engine import Engine
    from trainbus.plugins.checkpoints.checkpoint import Checkpointing
    from trainbus.plugins.control.preemption import Preemption

    model = _model()
    xs, ys = _data()
    batches = [(xs[i : i + 16], ys[i : i + 16]) for i in range(0, len(xs), 16)]
    checkpointing = Checkpointing(opts["out"], save_total_limit=opts.get("limit", 2), save_strategy="steps",
                                  save_steps=SAVE_STEPS, save_async=not opts.get("sync"))  # fmt: skip
    return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), train_data=batches, max_steps=MAX_STEPS,
                  loss_fn=torch.nn.MSELoss(), plugins=[checkpointing, Preemption()])  # fmt: skip


def _trainer(opts: dict[str, Any]) -> Any:
    from tests.facade_helpers import quiet_args
    from trainbus.plugins import Trainer

    args = quiet_args(opts["out"], max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE_STEPS,
                      save_total_limit=opts.get("limit", 2), save_async=not opts.get("sync"), learning_rate=1e-3,
                      optim="adamw_torch", per_device_train_batch_size=16, logging_steps=4, seed=3)  # fmt: skip
    xs, ys = _data()
    return Trainer(model=_model(), args=args, train_dataset=[{"x": x, "labels": y} for x, y in zip(xs, ys)])


def digest(model: Any, optimizer: Any) -> str:
    """sha256 of every weight's and optimizer state tensor's bytes, in a fixed order: equal means bit-exact."""
    import torch

    h = hashlib.sha256()
    state = optimizer.state_dict()["state"]
    named = [*sorted(model.state_dict().items()), *((f"{i}/{k}", state[i][k]) for i in state for k in sorted(state[i]))]
    for name, value in named:
        h.update(name.encode())
        h.update(torch.as_tensor(value).detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child(opts: dict[str, Any]) -> None:
    import torch

    from trainbus.engine import Event
    from trainbus.plugins.checkpoints import checkpoint

    torch.set_num_threads(1)
    log = Events(opts["events"], opts.get("hold"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE: the write fails (EFBIG)
    _logged_writes(log, opts.get("fsize") or [0, 0])
    if opts.get("slow"):
        _slowed(log, opts["slow"])
    run = _trainer(opts) if opts["kind"] == "trainer" else _engine(opts)
    pace, pause = opts.get("pace", 0.0), opts.get("pause") or [0, 0]

    def step_end(ev: Any) -> None:
        log(f"step {(step := ev.engine.state.global_step)}")
        if step == pause[0]:  # [step, seconds]: the training thread stops there (the parent signals it there)
            log(f"paused {step}")
            time.sleep(pause[1])
        time.sleep(pace)

    run.on(Event.STEP_END, step_end)
    resumed: list[Path] = []
    resume = checkpoint.resume  # the Trainer calls it too: the checkpoint a resume took
    checkpoint.resume = lambda *a, **k: resumed.append(resume(*a, **k)) or resumed[-1]  # type: ignore[assignment]
    if opts["kind"] == "trainer":
        run.train(resume_from_checkpoint=True if opts.get("resume") else None)
    else:
        if opts.get("resume"):
            checkpoint.resume(run, True)
        run.fit()
    result = {"digest": digest(run.model, run.optimizer), "step": run.state.global_step,
              "resumed_from": str(resumed[0]) if resumed else None}  # fmt: skip
    Path(opts["result"]).write_text(json.dumps(result))


# -- the parent -------------------------------------------------------------------------------------
_CONTEXT: Any = None
PRELOAD = ["torch", "torch._dynamo", "torch.optim", "trainbus.engine", "trainbus.plugins", "tests.facade_helpers",
           "transformers.trainer_utils",  # a Trainer resume imports it (peft: seconds)
           "tests.async_kill_jobs"]


def context() -> Any:
    """A forkserver that imported torch (and its dynamo, which an optimizer's constructor imports: seconds) and
    trainbus once: every run is a fresh process forked from it, ready in milliseconds."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _run_child(opts: dict[str, Any]) -> None:
    """The process's entry: its output into ``<events>.log``, then the run."""
    log = os.open(f"{opts['events']}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    child(opts)


def launch(**opts: Any) -> Any:
    """Start a run (a ``multiprocessing.Process``: ``pid``, ``exitcode``, ``join``); opts as the child takes them."""
    process = context().Process(target=_run_child, args=({k: str(v) if isinstance(v, Path) else v
                                                         for k, v in opts.items()},), daemon=False)  # fmt: skip
    process.start()
    return process


def output(events: Path) -> str:  # what the run printed (stdout and stderr)
    path = Path(f"{events}.log")
    return path.read_text() if path.exists() else ""


def read_events(path: Path) -> list[tuple[float, str]]:
    text = path.read_text() if path.exists() else ""
    lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only
    return [(float(t), what) for t, _, what in (line.partition(" ") for line in lines)]


def wait_for(path: Path, what: str, process: Any, after: float = 0.0) -> float:
    """Poll the events file until ``what`` appears after ``after`` (an event equal to it, or starting with it when it
    ends with a space); returns its time. Fails if the process ends first."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for t, seen in read_events(path):
            if t >= after and (seen == what or (what.endswith(" ") and seen.startswith(what))):
                return t
        if not process.is_alive():
            raise AssertionError(f"the run ended (exit {process.exitcode}) before '{what}': {output(path)}")
        time.sleep(0.002)
    process.kill()
    raise AssertionError(f"'{what}' did not come in {TIMEOUT} s")


def run_to_end(**opts: Any) -> dict[str, Any]:
    process = launch(**opts)
    process.join(TIMEOUT)
    assert process.exitcode == 0, f"exit {process.exitcode}: {output(opts['events'])}"
    return json.loads(Path(opts["result"]).read_text())  # type: ignore[no-any-return]


@dataclass
class Reference:
    out: Path  # an uninterrupted synchronous run's output_dir, every checkpoint kept
    digest: str


def reference(kind: str, work: Path) -> Reference:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "run"
    result = run_to_end(kind=kind, out=out, events=work / "events", result=work / "result.json", sync=True, limit=None)
    assert result["step"] == MAX_STEPS and result["resumed_from"] is None
    return Reference(out, result["digest"])


def same_tensors(checkpoint: Path, ref: Reference) -> bool:
    """Its safetensors files byte-equal to the reference's checkpoint of that step (a stop's: the resume checks it)."""
    theirs = ref.out / checkpoint.name.split(".")[0]
    names = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    same = bool(names) and names == sorted(p.name for p in theirs.glob("*.safetensors"))
    return not theirs.is_dir() or (same and all((checkpoint / n).read_bytes() == (theirs / n).read_bytes()
                                                for n in names))  # fmt: skip


def inspect_after_kill(out: Path, ref: Reference) -> dict[str, Any]:
    """What a killed run left: every ``checkpoint-N`` complete and equal to the reference's, the newest a resume
    will take (a complete leftover for a step without its checkpoint-N is put back by tidy), the leftovers."""
    from trainbus.plugins.checkpoints import verified
    from trainbus.plugins.checkpoints.directory import LEFTOVER, checkpoint_dirs

    steps = []
    for step, path in checkpoint_dirs(out):
        verified.read_manifest(path, verify=True)  # raises DamagedCheckpoint: a torn checkpoint-N
        assert same_tensors(path, ref), f"{path} differs from the uninterrupted run's checkpoint"
        steps.append(step)
    leftovers = sorted(p.name for p in out.iterdir() if LEFTOVER.match(p.name))
    for name in leftovers:  # a copy tidy puts back (directory.tidy): a .tmp or .old that verifies, its step missing
        step, kind = int(LEFTOVER.match(name)[1]), LEFTOVER.match(name)[2]  # type: ignore[index]
        if kind in ("tmp", "old") and step not in steps and _verifies(out / name):
            assert same_tensors(out / name, ref), f"{name} is complete but differs from the reference"
            steps.append(step)
    return {"steps": sorted(steps), "leftovers": leftovers}


def _verifies(path: Path) -> bool:
    from trainbus.plugins.checkpoints import verified
    from trainbus.plugins.checkpoints.safety import DamagedCheckpoint

    try:
        verified.read_manifest(path, verify=True)
    except DamagedCheckpoint:
        return False
    return True


def phase_at(events: list[tuple[float, str]], when: float) -> str:
    """The writer's last event before ``when`` (its first word; 'idle' once the last write had rotated)."""
    last = [what for t, what in events if t <= when and not what.startswith(("step", "waiting", "paused"))] or ["idle"]
    return "idle" if last[-1].startswith("rotated") else last[-1].split(" ")[0]


#: where a trial can hold the writer and kill it: the phase, and the event (text) the hold waits for
PHASES = {
    "before any file": "start ",
    "between tensor files": "/optimizer.",
    "before the last tensor file": "/rng.",
    "manifest written, not synced": "sync",
    "synced, not renamed": "publish ",
    "renamed, not rotated": "published",
    "rotation starting": "rotate",
    "rotation deleting": "remove",
}


def kill_trial(
    kind: str, work: Path, ref: Reference, seed: int, signum: int = signal.SIGKILL, phase: str | None = None,
    hold: float = 3600.0, training: str | None = None,
) -> dict[str, Any]:
    """One trial: a signal during the background write of a seeded save T, at a seeded random moment after it
    started, or while the writer is held in ``phase`` for ``hold`` s (and, with ``training``, once the training
    thread is paused 1 s in step T+1, "stepping", or waits for the write at its next save, "waiting"); what the run
    left is checked, then it is resumed from True to the end and compared with the uninterrupted run."""
    rng, out, events = random.Random(seed), work / "run", work / "events"
    work.mkdir(parents=True, exist_ok=True)
    target = SAVE_STEPS * rng.randint(3, MAX_STEPS // SAVE_STEPS - 1)  # 9..21: rotation has one to delete
    delay = rng.uniform(0, 12 * SLOW) if phase is None else 0.0
    held, pause = None if phase is None else [target, PHASES[phase], hold], [target + 1, 1.0]
    process = launch(kind=kind, out=out, events=events, result=work / "killed.json", slow=SLOW, pace=PACE, hold=held,
                     pause=pause if training == "stepping" else None)  # fmt: skip
    started = wait_for(events, f"start {target}", process)
    if phase is not None:
        wait_for(events, "holding ", process)
    if training is not None:  # the wait at the next save is for T: one write in flight
        wait_for(events, "paused " if training == "stepping" else "waiting", process, after=started)
    time.sleep(delay)
    signalled = time.monotonic()
    os.kill(process.pid, signum)
    process.join(TIMEOUT)
    seen = read_events(events)
    record = {"seed": seed, "kind": kind, "signal": signal.Signals(signum).name, "target": target, "delay": delay,
              "exit": process.exitcode, "phase": phase or phase_at(seen, signalled), "signalled": signalled,
              "events": seen, "output": output(events), "output_dir": str(out)}  # fmt: skip
    ended = [int(w.split()[1]) for t, w in seen if w.startswith("end ") and t <= signalled]
    record["in_write"], record["published"] = record["phase"] != "idle", max(ended, default=0)
    record["left"] = inspect_after_kill(out, ref)
    result = run_to_end(kind=kind, out=out, events=work / "events-resume", result=work / "resumed.json", resume=True)
    record["resumed_from"], record["bit_exact"] = result["resumed_from"], result["digest"] == ref.digest
    record["after"] = inspect_after_kill(out, ref)
    return record


def check_trial(record: dict[str, Any]) -> None:
    """The promises of one trial (the test asserts them; the benchmark counts them)."""
    left, after = record["left"], record["after"]
    assert left["steps"], f"no complete checkpoint after the kill: {record}"
    assert left["steps"][-1] >= record["published"], f"a published checkpoint was lost: {record}"
    assert record["resumed_from"] is not None and record["resumed_from"].endswith(f"checkpoint-{left['steps'][-1]}")
    assert record["bit_exact"], f"the resumed run differs from the uninterrupted one: {record}"
    assert after["leftovers"] == [], f"leftovers not tidied: {after}"
    assert after["steps"] == [MAX_STEPS - SAVE_STEPS, MAX_STEPS], f"rotation after the resume: {after}"


